"""The Trainer precision strings the memory models take: one list for :mod:`.model_states` and :mod:`.activations`
(each checks its ``precision`` against it), kept below both so that neither imports the other for it."""

#: Low precision: what compute reads is 2 bytes an element; the model states at rest stay fp32
#: (``model_states.compute_bytes``, ``[Note: ZeroStrategy's bytes under mixed precision]``). What each means for
#: activations: ``activations._dtype_bytes`` and ``activations.precision_at_stage``.
LOW_PRECISIONS = ("16-mixed", "bf16-mixed", "16-true", "bf16-true", "16", "bf16")
PRECISIONS = ("32-true", "32") + LOW_PRECISIONS

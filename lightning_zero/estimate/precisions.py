"""The Trainer precision strings the memory models take: one list for :mod:`.model_states` and :mod:`.activations`
(each checks its ``precision`` against it), kept below both so that neither imports the other for it."""

#: Low precision for the model states: 2-byte parameters and gradients, and the fp32 master copy joins the optimizer
#: states (``model_states.precision_bytes``). What each means for activations: ``activations._dtype_bytes``.
LOW_PRECISIONS = ("16-mixed", "bf16-mixed", "16-true", "bf16-true", "16", "bf16")
PRECISIONS = ("32-true", "32") + LOW_PRECISIONS

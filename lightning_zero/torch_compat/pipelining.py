"""``torch.distributed.pipelining`` internals the package's ZBV schedules need (``pipeline/schedules.py``)."""

from __future__ import annotations


def stage_warmup_ops(stage):
    """The bound method a ``PipelineStage`` builds its neighbour warm-up messages with
    (``_get_init_p2p_neighbors_ops``, torch 2.11's ``PipelineScheduleMulti`` warm-up), or ``None`` where this torch
    has none; :func:`set_stage_warmup_ops` replaces it."""
    return getattr(stage, "_get_init_p2p_neighbors_ops", None)


def set_stage_warmup_ops(stage, ops) -> None:
    """Make the zero-argument ``ops`` the stage's warm-up message builder (see :func:`stage_warmup_ops`)."""
    stage._get_init_p2p_neighbors_ops = ops


def lower_forward_actions(schedule, num_stages: int) -> dict:
    """``{rank: actions}`` of ``schedule``'s forward actions only, lowered to send/recv by torch's private
    ``_add_send_recv`` (its public lowering refuses a micro-batch without a backward): what a forward-only
    ``ScheduleZBVZeroBubble`` runs for evaluation. ``_ComputationType`` names the kinds of action."""
    from torch.distributed.pipelining.schedules import _add_send_recv, _ComputationType

    forward_only = {
        rank: [a for a in actions if a is not None and a.computation_type == _ComputationType.FORWARD]
        for rank, actions in schedule.pipeline_order.items()
    }
    return _add_send_recv(
        forward_only, stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s], num_stages=num_stages
    )

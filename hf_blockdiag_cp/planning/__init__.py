"""Host-side planning: pure functions from document ids to small plans, run once per step."""

from .documents import as_doc_ids, doc_ids_from_cu_seqlens, doc_ids_from_position_ids, document_spans
from .varlen import PlanError, QueryPiece, Segment, VarlenPlan, build_varlen_plan, plan_from_segments

__all__ = [
    "PlanError",
    "QueryPiece",
    "Segment",
    "VarlenPlan",
    "as_doc_ids",
    "build_varlen_plan",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_position_ids",
    "document_spans",
    "plan_from_segments",
]

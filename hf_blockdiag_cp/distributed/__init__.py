"""Context parallelism: the host-side exchange plan, the differentiable K/V exchanges and the runtime."""

from .plan import ExchangePlan, needed_ranges, plan_exchange

__all__ = ["ExchangePlan", "needed_ranges", "plan_exchange"]

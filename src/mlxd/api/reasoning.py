"""Reasoning budgets from each dialect's words: vLLM's ``thinking_token_budget``, OpenAI's
``reasoning_effort`` / ``reasoning.effort``, Anthropic's ``thinking.budget_tokens``,
Ollama's ``think`` levels. An effort is a budget from ``engine.reasoning_effort_budgets``;
"none" also asks the template to leave thinking out (``enable_thinking``), and its budget
of 0 closes a part the template opens anyway."""

from __future__ import annotations

from typing import Any

from mlxd.config import ReasoningEffort, Settings
from mlxd.core.types import GenerateRequest


def apply_reasoning(
    req: GenerateRequest,
    settings: Settings,
    budget: int | None = None,
    effort: ReasoningEffort | None = None,
) -> None:
    """Set ``req``'s reasoning budget (an explicit budget wins over an effort)."""
    if effort is not None:
        req.thinking_budget = settings.engine.reasoning_effort_budgets.get(effort)
        if effort == "none":
            kwargs: dict[str, Any] = dict(req.template_kwargs or {})
            kwargs.setdefault("enable_thinking", False)
            req.template_kwargs = kwargs
    if budget is not None:
        req.thinking_budget = budget

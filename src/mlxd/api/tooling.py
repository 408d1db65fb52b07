"""Tools, tool choice and structured-output formats: each dialect's wire shape -> core types.

Every dialect's tools become OpenAI function tools (``{"type": "function", "function":
{"name", "description", "parameters"}}``), the shape chat templates take; tool choices
become (choice, name); response formats become an :class:`OutputConstraint`.
"""

from __future__ import annotations

import json
from typing import Any

from mlxd.core.errors import InvalidRequest
from mlxd.core.types import GenerateRequest, OutputConstraint, ToolCall


def function_tool(
    name: Any, description: Any = None, parameters: Any = None, param: str = "tools"
) -> dict:
    if not isinstance(name, str) or not name:
        raise InvalidRequest("every tool needs a name", param=param)
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest(f"tool '{name}': parameters must be a JSON schema object", param=param)
    fn: dict[str, Any] = {"name": name}
    if description:
        fn["description"] = str(description)
    fn["parameters"] = (
        parameters if parameters is not None else {"type": "object", "properties": {}}
    )
    return {"type": "function", "function": fn}


def openai_tools(tools: list[dict] | None) -> list[dict] | None:
    """Chat Completions tools (``{"type": "function", "function": {...}}``)."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise InvalidRequest(
                f"tools[{i}]: only function tools are supported", param=f"tools[{i}]"
            )
        fn = t["function"]
        out.append(
            function_tool(
                fn.get("name"), fn.get("description"), fn.get("parameters"), param=f"tools[{i}]"
            )
        )
    _unique(out)
    return out


def _unique(tools: list[dict]) -> None:
    names = [t["function"]["name"] for t in tools]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise InvalidRequest(f"tool names must be unique: {sorted(dup)}", param="tools")


def tool_names(tools: list[dict] | None) -> list[str]:
    return [t["function"]["name"] for t in tools or []]


def check_tool_calls(calls: Any, param: str) -> list[dict]:
    """An earlier assistant turn's ``tool_calls`` (Chat Completions' shape: ``{"id",
    "type": "function", "function": {"name", "arguments"}}``, arguments a JSON string or an
    object) as templates take them; a malformed one is a 400 naming its field, never a
    failure inside the template or the tool-call code."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"{param} must be a list of tool calls", param=param)
    out = []
    for k, tc in enumerate(calls):
        where = f"{param}[{k}]"
        if not isinstance(tc, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        if tc.get("type", "function") != "function":
            raise InvalidRequest(f"{where}.type must be 'function'", param=f"{where}.type")
        if not isinstance(tc.get("id", ""), str):
            raise InvalidRequest(f"{where}.id must be a string", param=f"{where}.id")
        fn = tc.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequest(
                f"{where}.function must be an object with a name and arguments",
                param=f"{where}.function",
            )
        out.append(
            {**tc, "function": check_call(fn.get("name"), fn.get("arguments"), f"{where}.function")}
        )
    return out


def check_call(
    name: Any,
    arguments: Any,
    param: str,
    *,
    name_field: str = "name",
    arguments_field: str = "arguments",
) -> dict:
    """One earlier call's ``{"name", "arguments"}``: a non-empty name, and arguments that
    are a JSON string, an object or absent (``{}``)."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest(
            f"{param}.{name_field} must be a non-empty string", param=f"{param}.{name_field}"
        )
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, (str, dict)):
        raise InvalidRequest(
            f"{param}.{arguments_field} must be a JSON string or an object",
            param=f"{param}.{arguments_field}",
        )
    return {"name": name, "arguments": arguments}


def openai_tool_choice(choice: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    """``"auto" | "none" | "required" | {"type": "function", "function": {"name"}}`` (Chat
    Completions) or ``{"type": "function", "name"}`` (Responses) -> (choice, name)."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequest(f"unknown tool_choice '{choice}'", param="tool_choice")
        if choice == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
        return choice, None
    if isinstance(choice, dict):
        if choice.get("type") == "allowed_tools":
            return openai_tool_choice(choice.get("mode", "auto"), tools)
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        if choice.get("type") == "function" and isinstance(name, str):
            return "function", _known(name, tools)
    raise InvalidRequest(
        "tool_choice must be 'auto', 'none', 'required' or a function", param="tool_choice"
    )


def _known(name: str, tools: list[dict] | None) -> str:
    if name not in tool_names(tools):
        raise InvalidRequest(
            f"tool_choice names '{name}', which is not among the tools", param="tool_choice"
        )
    return name


def apply_tools(
    req: GenerateRequest,
    tools: list[dict] | None,
    choice: tuple[str, str | None],
    parallel: bool | None,
) -> None:
    req.tools = tools
    req.tool_choice, req.tool_name = choice  # type: ignore[assignment]
    if parallel is not None:
        req.parallel_tool_calls = parallel


def json_schema_constraint(schema: Any, param: str = "response_format") -> OutputConstraint:
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("the JSON schema must be an object", param=param)
    return OutputConstraint("json_schema", json.dumps(schema))


def openai_response_format(
    rf: dict | None, param: str = "response_format"
) -> OutputConstraint | None:
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}``;
    Responses' ``text.format`` puts the schema at the top level (``{"type": "json_schema",
    "name", "schema"}``): both are accepted."""
    if not rf:
        return None
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return OutputConstraint("json_object")
    if kind == "json_schema":
        spec = rf.get("json_schema", rf)
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequest("json_schema needs a 'schema'", param=param)
        return json_schema_constraint(spec["schema"], param)
    if kind == "regex" and isinstance(rf.get("pattern") or rf.get("regex"), str):  # extension
        return OutputConstraint("regex", rf.get("pattern") or rf["regex"])
    if kind in ("grammar", "lark") and isinstance(rf.get("grammar"), str):  # extension
        return OutputConstraint("lark", rf["grammar"])
    raise InvalidRequest(f"unsupported response_format type '{kind}'", param=param)


def openai_tool_calls(calls: list[ToolCall], streaming_from: int | None = None) -> list[dict]:
    out = []
    for k, c in enumerate(calls):
        d: dict[str, Any] = {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        if streaming_from is not None:
            d = {"index": streaming_from + k, **d}
        out.append(d)
    return out


def arguments_dict(call: ToolCall) -> dict:
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}

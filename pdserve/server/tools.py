"""Tool calls for chat (`tools`, `tool_choice`): the prompt that offers the functions, the grammar that keeps a
call's arguments to the declared schema, and the answer's `tool_calls` (whole, or streamed as OpenAI sends them).

A call is written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes convention most open
chat models are trained on). By `tool_choice`:
* a named function (`{"type": "function", "function": {"name": N}}`): the answer is that function's
  arguments, constrained to its `parameters` schema (finish_reason `stop`, as OpenAI and vLLM give it);
* `required`: one or more calls (one with `parallel_tool_calls: false`), each constrained to one declared
  function's name and schema (finish_reason `tool_calls`);
* `auto` (the default with tools): text, or calls constrained as above: the grammar lets the model choose;
* `none`: the tools are not offered.

The functions go to the model's chat template as `tools` when the template uses them; a template that does
not (the default model's) gets them in a system message instead, counted as the fallback
`tools_in_system_prompt`. Earlier assistant `tool_calls` and `tool` results in `messages` are passed the same
way: to the template, or written into the text as the model would have produced them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError
from pdserve.server.structured import JSON_OPTIONS, Grammars

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


@dataclass
class ToolPlan:
    mode: str  # named | required | auto
    functions: list[dict]  # {"name", "description", "parameters"}
    grammar: str
    name: str | None = None  # the named function

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The assistant message for a whole answer, and its finish reason."""
        if self.mode == "named":
            return {"role": "assistant", "content": None, "tool_calls": [_call(self.name, text)]}, reason
        content, calls = split_calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, reason
        return ({"role": "assistant", "content": content or None, "tool_calls": calls},
                "tool_calls" if reason == "stop" else reason)


def plan_tools(req, grammars: Grammars) -> ToolPlan | None:
    """What a chat request's `tools` / `tool_choice` ask for (None: no tool is offered)."""
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    for j, name in enumerate(names):
        if name in names[:j]:
            raise InvalidRequestError(f"tools declares the function {name!r} twice", param=f"tools[{j}].function.name")
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        match = [f for f in functions if f["name"] == name]
        if not match:
            raise InvalidRequestError(f"tool_choice names no declared function: {name!r}", param="tool_choice")
        param = f"tools[{functions.index(match[0])}].function.parameters"
        return ToolPlan("named", functions, grammars.json_schema(match[0]["parameters"], param), name)
    if choice not in ("auto", "required"):
        raise InvalidRequestError(f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                                  param="tool_choice")
    parallel = getattr(req, "parallel_tool_calls", None) is not False
    # (a newline may open and close a call's JSON, as Hermes-style chat templates write it)
    calls = f'("{OPEN}" NL? call NL? "{CLOSE}" NL?)' + ("+" if parallel else "")
    call = {"anyOf": [_call_schema(f) for f in functions], "x-guidance": JSON_OPTIONS}
    lark = (f"start: {'TEXT | ' if choice == 'auto' else ''}calls\ncalls: {calls}\ncall: %json {json.dumps(call)}\n"
            'NL: "\\n"\n' + ("TEXT: /[^<][\\s\\S]*/\n" if choice == "auto" else ""))
    import llguidance
    return ToolPlan(choice, functions, grammars.check(llguidance.LLMatcher.grammar_from_lark(lark), "tools"))


def prompt_messages(messages: list[dict], plan: ToolPlan | None, template_takes_tools: bool
                    ) -> tuple[list[dict], list[dict] | None]:
    """(messages for the template, its `tools` argument): the template's own way when it has one."""
    if template_takes_tools:
        tools = None if plan is None else [{"type": "function", "function": f} for f in plan.functions]
        return messages, tools
    out = [_as_text(m) for m in messages]
    if plan is not None:
        note = _system_note(plan)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, None


def split_calls(text: str) -> tuple[str, list[dict]]:
    """(the text before the first call, the calls that parse)."""
    calls = []
    for m in _CALL.finditer(text):
        try:
            body = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(body, dict) and isinstance(body.get("name"), str):
            calls.append(_call(body["name"], json.dumps(body.get("arguments", {}))))
    first = text.find(OPEN)
    return (text if first < 0 else text[:first]).strip(), calls


class ToolStream:
    """One streamed choice's deltas: text in, OpenAI `delta` objects out (content, or `tool_calls` pieces)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.buffer = ""
        self.calls = 0
        self.in_text = False  # auto: the answer is plain text

    def feed(self, text: str) -> list[dict]:
        if self.plan.mode == "named":
            out = [] if self.calls else [{"tool_calls": [{**_call(self.plan.name, ""), "index": 0}]}]
            self.calls = 1
            return out + ([{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else [])
        if self.in_text:
            return [{"content": text}] if text else []
        self.buffer += text
        head = self.buffer.lstrip()
        if self.plan.mode == "auto" and not self.calls and head and not OPEN.startswith(head[:len(OPEN)]):
            self.in_text, self.buffer = True, ""
            return [{"content": head}]
        out = []
        while CLOSE in self.buffer:
            piece, self.buffer = self.buffer.split(CLOSE, 1)
            _, calls = split_calls(piece + CLOSE)
            for call in calls:
                out.append({"tool_calls": [{**call, "index": self.calls}]})
                self.calls += 1
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.plan.mode != "named" and self.calls and reason == "stop" else reason


def _function(tool, i: int) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
        raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}} with a "
                                  "name of letters, digits, _ or - (at most 64)", param=f"tools[{i}]")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                                  param=f"tools[{i}].function.parameters")
    return {"name": fn["name"], "description": fn.get("description") or "", "parameters": params}


def _call_schema(f: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def _call(name: str, arguments: str) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _system_note(plan: ToolPlan) -> str:
    listing = "\n".join(json.dumps(f) for f in plan.functions)
    if plan.mode == "named":
        return (f"Call the function {plan.name}. Reply with its arguments only, as one JSON object.\n"
                f"<tools>\n{listing}\n</tools>")
    return ("You may call functions. To call one, reply with "
            f'{OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CLOSE}'
            f" for each call.\n<tools>\n{listing}\n</tools>")


def _as_text(m: dict) -> dict:
    """A message with tool calls or a tool result, written out for a template that knows neither."""
    calls = m.get("tool_calls")
    if calls:
        written = "".join(OPEN + json.dumps({"name": c["function"]["name"],
                                             "arguments": _json_or_text(c["function"].get("arguments"))}) + CLOSE
                          for c in calls)
        m = {**m, "content": (m.get("content") or "") + written}
    if m["role"] == "tool":
        m = {**m, "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
    return {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}


def _json_or_text(s):
    try:
        return json.loads(s) if isinstance(s, str) else s
    except json.JSONDecodeError:
        return s

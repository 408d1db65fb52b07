"""Chat-template renders: bounded in time and in number, and interrupted with their request.

A chat template is a Jinja program (the model's, or the operator's); rendering it over a
large conversation is pure Python that can run for long, and ``asyncio.to_thread`` would
let it run on after its client left or its deadline passed, holding the GIL and a pool
thread. A Python thread cannot be killed, but one that runs Python bytecode can be
interrupted: ``PyThreadState_SetAsyncExc`` raises an exception in it at its next bytecode.
So each render runs on a thread of its own that does nothing else (a pooled thread could
have moved on to other work by the time the exception lands), and the interruption is sent
only while that thread is still inside the render: a lock orders "the render ended" against
"interrupt it", and an interruption sent but not yet raised when the render ends is cleared
before the thread runs anything else. A render inside C code (a tokenizer's Rust encode)
sees the interruption when it returns to Python; its slot is held until its thread ends.

Template variables a request may set are checked here too (:func:`check_template_kwargs`):
only variables, never a template nor an argument of the render itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from mlxd.core.errors import InvalidRequest, QueueFull, TemplateTimeout

T = TypeVar("T")

# Names a request's template variables must not take: the arguments of transformers'
# apply_chat_template and of its Jinja render (a template, the messages, tokenizer options),
# of mlx-lm's and mlx-vlm's wrappers around it, the tokenizer's special tokens it passes in,
# and the template environment's globals.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        # transformers: PreTrainedTokenizerBase.apply_chat_template and render_jinja_template
        "conversation",
        "conversations",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "kwargs",
        "add_special_tokens",
        # the special tokens it passes to every template
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        # the template environment's globals
        "raise_exception",
        "strftime_now",
        "dict",
        "namespace",
        "range",
        "lipsum",
        "cycler",
        "joiner",
        # mlx-vlm's apply_chat_template / get_chat_template / get_message_json
        "processor",
        "config",
        "prompt",
        "return_messages",
        "num_images",
        "num_audios",
        "skip_image_token",
        "skip_audio_token",
        "model_name",
        "role",
        "audio_token",
        "image_token",
        "video_token",
    }
)

# Bounds on a request's template variables: flags and short settings, not documents.
MAX_TEMPLATE_VARIABLES = 32
MAX_TEMPLATE_DEPTH = 6
MAX_TEMPLATE_VALUES = 1000
MAX_TEMPLATE_TEXT = 64 * 1024


def check_template_kwargs(
    kwargs: Any, param: str = "chat_template_kwargs", reserved: frozenset[str] = frozenset()
) -> dict | None:
    """``kwargs`` if it is a small mapping of template variables, else a 400 naming
    ``param``: a name that is a template, the messages or a render argument (the template is
    the model's or the operator's; a caller's would run their code on the server) and
    values beyond the bounds above. ``reserved`` adds names (a tokenizer's own arguments)."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise InvalidRequest(f"{param} must be an object of template variables", param=param)
    if len(kwargs) > MAX_TEMPLATE_VARIABLES:
        raise InvalidRequest(
            f"{param} has {len(kwargs)} variables; at most {MAX_TEMPLATE_VARIABLES} are accepted",
            param=param,
        )
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise InvalidRequest(f"{param}: {key!r} is not a template variable name", param=param)
        if key in RESERVED_TEMPLATE_VARIABLES or key in reserved:
            raise InvalidRequest(
                f"{param} may set template variables only; '{key}' is set by the server "
                "(templates come from the model or the operator)",
                param=param,
            )
    values, text = 0, 0
    stack: list[tuple[Any, int]] = [(v, 1) for v in kwargs.values()]
    while stack:
        v, depth = stack.pop()
        values += 1
        if depth > MAX_TEMPLATE_DEPTH or values > MAX_TEMPLATE_VALUES:
            raise InvalidRequest(
                f"{param} is too large (at most {MAX_TEMPLATE_VALUES} values, "
                f"nested {MAX_TEMPLATE_DEPTH} deep)",
                param=param,
            )
        if isinstance(v, str):
            text += len(v)
        elif isinstance(v, dict):
            text += sum(len(k) for k in v)
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
        if text > MAX_TEMPLATE_TEXT:
            raise InvalidRequest(
                f"{param} is too large (at most {MAX_TEMPLATE_TEXT} characters of text)",
                param=param,
            )
    return kwargs


class RenderInterrupted(BaseException):
    """Raised inside a render that was interrupted. A BaseException, so that an ``except
    Exception`` in a template library cannot swallow it and render on."""


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode (None clears one that is
    pending and not raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


class _Render:
    """One render on its own thread; settles on the loop with its outcome."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple,
        loop: asyncio.AbstractEventLoop,
        done: Callable[[tuple[bool, Any]], None],
    ) -> None:
        self.fn, self.args, self.loop, self.done = fn, args, loop, done
        self.lock = threading.Lock()
        self.running = False  # the thread is between the render's start and its end
        self.interrupted = False
        self.thread = threading.Thread(target=self._main, name="mlxd-render", daemon=True)

    def _main(self) -> None:
        outcome: tuple[bool, Any] = (False, RenderInterrupted())
        try:
            try:
                with self.lock:
                    if self.interrupted:  # given up before it began
                        raise RenderInterrupted()
                    self.running = True
                outcome = (True, self.fn(*self.args))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                outcome = (False, exc)
            finally:
                with self.lock:
                    self.running = False
                    if self.interrupted:  # sent, maybe not raised yet: not for what follows
                        _set_async_exc(threading.get_ident(), None)
        except RenderInterrupted as exc:  # raised between the render's end and the lock
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop has closed (shutdown)
            self.loop.call_soon_threadsafe(self.done, outcome)

    def interrupt(self) -> None:
        """Stop the render at its next bytecode, if it still runs (at most once)."""
        with self.lock:
            first, self.interrupted = not self.interrupted, True
            if first and self.running and self.thread.ident is not None:
                _set_async_exc(self.thread.ident, RenderInterrupted)


class Renderer:
    """Runs renders (templating and tokenizing a prompt) each on a thread of its own, at most
    ``max_concurrent`` at once, each for at most ``timeout_s``; a render whose request is
    cancelled (its client left) or past its deadline is interrupted."""

    def __init__(self, timeout_s: float, max_concurrent: int) -> None:
        self.timeout_s = timeout_s
        self.max_concurrent = max_concurrent
        self._slots: asyncio.Semaphore | None = None
        self.running = 0  # renders whose thread has not ended (interrupted ones included)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on its own thread: its result or exception; a 400 (TemplateTimeout)
        past the deadline, a 429 when no slot frees up within it."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrent)
        slots = self._slots
        try:
            if sys.version_info >= (3, 11):
                async with asyncio.timeout(self.timeout_s):  # a slot is never lost to a race
                    await slots.acquire()
            else:  # no asyncio.timeout on 3.10: wait_for, whose rare race can lose a slot
                await asyncio.wait_for(slots.acquire(), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):  # distinct classes before 3.11
            raise QueueFull(
                "too many prompts are being templated; retry shortly", headers={"Retry-After": "1"}
            ) from None
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()
        abandoned = False

        def done(outcome: tuple[bool, Any]) -> None:
            self.running -= 1
            slots.release()
            if abandoned or result.done():
                return
            ok, value = outcome
            if ok:
                result.set_result(value)
            else:
                result.set_exception(value)

        job = _Render(fn, args, loop, done)
        try:
            job.thread.start()
        except BaseException:
            slots.release()
            raise
        self.running += 1
        try:
            finished, _ = await asyncio.wait({result}, timeout=self.timeout_s)
        except BaseException:  # cancelled: the client left
            abandoned = True
            job.interrupt()
            raise
        if not finished:
            abandoned = True
            job.interrupt()
            raise TemplateTimeout(
                f"the chat template did not finish within {self.timeout_s:g} s for this "
                "request (server.template_timeout_s); send fewer or shorter messages",
                param="messages",
            )
        return result.result()

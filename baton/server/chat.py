"""The chat endpoint's work (a part of OpenAIServing): the conversation through the chat template
(tools, template kwargs), the run, and the answer: tool calls, and with a reasoning parser the
thoughts apart from the answer, non-streamed and as deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from functools import partial

from baton.sampling_params import SamplingParams, StructuredOutputsParams
from baton.server.protocol import ChatCompletionRequest
from baton.server.reasoning import PARSERS, ReasoningParser
from baton.server.responses import ChoiceStream, chat_logprobs, sse, stream_safe_text, usage
from baton.server.tool_formats import template_format
from baton.server.tools import parse_reply, plan_tools
from baton.tokenizer import apply_chat_template

ReadTools = Callable[[str], tuple[str | None, list[dict]]] | None  # a reply -> (content, tool calls)


class ChatServing:
    def _chat_ids(self, body: ChatCompletionRequest) -> tuple[list[int], StructuredOutputsParams | None, ReadTools]:
        """The conversation's token ids, the grammar its tools put on the reply (None without), and
        how a reply's tool calls are read (None: no tools offered): in the generic format, or in the
        template's own."""
        choice = body.tool_choice_value()
        if choice not in (None, "none", "auto") and not body.tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        tools = [t.model_dump() for t in body.tools] if body.tools else None
        kwargs = body.template_kwargs()
        messages = [m.as_template_dict() for m in body.messages]
        tok = self.engine.tokenizer
        fmt = template_format(self.config.tool_call_parser, getattr(tok, "chat_template", None))
        in_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if fmt is not None and (tools or in_history):  # the template renders the tools and the history itself
            offered = tools if choice != "none" else None
            ids = apply_chat_template(tok, messages, tools=offered, **kwargs)
            if not offered:
                return ids, None, None
            name = choice["function"]["name"] if isinstance(choice, dict) else None
            named = [t for t in tools if t["function"]["name"] == name]
            if name is not None and not named:
                raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
            forced = named or (tools if choice == "required" else None)
            spec = fmt.grammar(forced, bool(body.parallel_tool_calls)) if forced else None
            return ids, spec, partial(fmt.parse, tools=offered)
        plan = plan_tools(messages, tools, choice, bool(body.parallel_tool_calls))
        read = parse_reply if plan.structured is not None else None
        return apply_chat_template(tok, plan.messages, **kwargs), plan.structured, read

    @staticmethod
    def _message(text: str, finish_reason: str | None, read_tools: ReadTools) -> tuple[dict, str | None]:
        """The assistant message of a finished answer and its finish reason (tool_calls for calls)."""
        if read_tools is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = read_tools(text)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": content}, finish_reason

    def _reasoning(self, ids: list[int]) -> tuple[ReasoningParser | None, bool]:
        """The server's reasoning parser, and whether the prompt opened the thinking."""
        parser = PARSERS.get(self.config.reasoning_parser or "")
        if parser is None:
            return None, False
        return parser, parser.opens_in_prompt(self._decode(ids[-8:]))

    @staticmethod
    def _chat_params(body: ChatCompletionRequest, tool_spec, max_tokens: int, logprobs: int | None) -> SamplingParams:
        params = body.sampling_params(max_tokens, logprobs, None)
        if tool_spec is not None:
            if params.structured_outputs is not None:
                raise ValueError("tools and response_format (or another output constraint) cannot be combined")
            params.structured_outputs = tool_spec
        return params

    async def chat(self, body: ChatCompletionRequest, rid: str, raw_stream: bool = False):
        """The answer (a dict), or streamed an SSE response (`raw_stream`: its chunks' generator)."""
        self.admit(body.n)
        ids, tool_spec, read_tools = await self.off_loop(self._chat_ids, body)
        _, ids, max_tokens = await self.off_loop(
            self._prepare, {"prompt_token_ids": ids}, body, body.max_completion_tokens or body.max_tokens
        )
        top_n = body.top_logprobs or 0
        params = self._chat_params(body, tool_spec, max_tokens, top_n if body.logprobs else None)
        reasoning = self._reasoning(ids)
        parser, opened = reasoning
        if parser is not None and params.structured_outputs is not None and body.thinking_enabled():
            # the constraint holds once the thinking ends (with thinking off, from the first token)
            params.structured_outputs.thinking = "open" if opened or parser.thinks_without_start else "optional"
        await self.off_loop(self._check, [ids], [params])
        gen = self._tracked(ids, params, rid, kv_span=self._parked_span(body))
        if body.stream:
            chunks = self._chat_stream(body, rid, ids, top_n, gen, read_tools, reasoning)
            return chunks if raw_stream else sse(chunks)
        (out,) = await self._final([gen])
        choices = []
        for c in out.outputs:
            thought, answer = parser.split(c.text, opened, True) if parser is not None else ("", c.text)
            message, finish_reason = self._message(answer, c.finish_reason, read_tools)
            if parser is not None:
                message["reasoning_content"] = thought or None
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, self.piece, top_n) if body.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
            if c.error:
                choice["error"] = c.error
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        response = {**self._header(rid, "chat.completion"), "choices": choices}
        response["usage"] = usage(len(ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)
        if body.return_token_ids:
            response["prompt_token_ids"] = ids
        return response

    async def _chat_stream(self, body, rid, ids, top_n, gen, read_tools, reasoning) -> AsyncIterator[dict]:
        """With a reasoning parser, thoughts go out as `reasoning_content` deltas, then the answer's.
        With tools the answer is parsed when it is complete: its content, then each call's name and
        arguments go out as deltas before the final chunk."""
        parser, opened = reasoning
        head = self._header(rid, "chat.completion.chunk")
        opts = body.stream_options
        continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        first = {
            **head,
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(body.n)
            ],
        }
        if body.return_token_ids:
            first["prompt_token_ids"] = ids
        if continuous:
            first["usage"] = usage(len(ids), 0, 0)
        yield first
        states = [ChoiceStream() for _ in range(body.n)]
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        completion_tokens = cached = 0
        async for _, out in self._merge([gen]):
            cached = out.num_cached_tokens
            for c in out.outputs:
                st = states[c.index]
                if st.finished:
                    continue
                done = c.finish_reason is not None
                if read_tools is not None and not done and parser is None:
                    continue
                safe = stream_safe_text(c.text, done, stop)
                thought = ""
                if parser is not None:
                    thought, safe = parser.split(safe, opened, done)
                    thought = thought[st.reasoning_sent :]
                answer, safe = safe, ("" if read_tools is not None else safe)  # with tools: held to the end
                delta = safe[st.text_sent :]
                new_ids = c.token_ids[st.tokens_sent :]
                if not (delta or thought or done or (body.return_token_ids and new_ids)):
                    continue
                choice = {"index": c.index, "delta": {"content": delta}, "logprobs": None, "finish_reason": None}
                if thought:
                    choice["delta"]["reasoning_content"] = thought
                    st.reasoning_sent += len(thought)
                finish_reason = c.finish_reason
                if read_tools is not None and done:
                    message, finish_reason = self._message(answer, c.finish_reason, read_tools)
                    deltas = [choice["delta"]] if thought else []
                    choice["delta"] = {}
                    deltas += [{"content": message["content"]}] if message["content"] is not None else []
                    for d in deltas + _call_deltas(message.get("tool_calls") or []):  # a call's name, then arguments
                        yield {**head, "choices": [{"index": c.index, "delta": d, "logprobs": None}]}
                if body.logprobs:
                    entries = c.logprobs[st.tokens_sent : st.tokens_sent + len(new_ids)]
                    choice["logprobs"] = chat_logprobs(new_ids, entries, self.piece, top_n)
                if body.return_token_ids:
                    choice["token_ids"] = new_ids
                if done:
                    choice["finish_reason"] = finish_reason
                    choice["stop_reason"] = c.stop_reason
                    if c.error:
                        choice["error"] = c.error
                    st.finished = True
                    completion_tokens += len(c.token_ids)
                st.text_sent += len(delta)
                st.tokens_sent += len(new_ids)
                chunk = {**head, "choices": [choice]}
                if continuous:
                    chunk["usage"] = usage(len(ids), sum(x.tokens_sent for x in states), cached)
                yield chunk
        if body.stream_options and body.stream_options.include_usage:
            yield {**head, "choices": [], "usage": usage(len(ids), completion_tokens, cached)}


def _call_deltas(calls: list[dict]) -> list[dict]:
    """A reply's tool calls as OpenAI streams them: per call, its id and name, then its arguments."""
    out = []
    for i, call in enumerate(calls):
        name = {"name": call["function"]["name"], "arguments": ""}
        out.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function", "function": name}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
    return out

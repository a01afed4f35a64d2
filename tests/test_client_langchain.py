"""langchain-tests' standard chat-model integration suite, unchanged, through langchain-openai's
`ChatOpenAI` against a real `baton serve` (SmolLM2-135M, its template's generic tool format).
Slow: `make test-slow` installs the `clients` extra it needs.

What the suite is told about the server: tools, tool_choice, structured output in json_schema
mode, JSON mode, usage in invoke and stream (cached prompt tokens too); no image, audio or PDF
input (a text model); no per-call model override (one server serves one model, as `vllm serve`
does). Tests a 135M model cannot answer are listed in XFAIL with the reason; each still runs and
is reported, and one that passes is reported XPASS."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")
pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402

from tests.server_util import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow

# what the suite asks that SmolLM2-135M cannot answer (the server's side of each is tested too)
XFAIL = {
    # JSON mode holds the reply to JSON, not to a schema; the schema is only described in the prompt,
    # and SmolLM2-135M leaves out a key it names (json_schema mode, which holds it, passes)
    "test_json_mode": "the 135M model does not follow a schema it is only told of in the prompt",
}

_server: ServerProcess | None = None


@pytest.fixture(scope="module", autouse=True)
def server():
    global _server
    _server = ServerProcess()
    yield _server
    _server.terminate()
    _server = None


@pytest.fixture(autouse=True)
def _known_failures(request):
    reason = XFAIL.get(request.node.originalname)
    if reason:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=False))


class TestBatonChatOpenAI(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict:
        assert _server is not None
        return {
            "model": "smollm2-135m",
            "base_url": f"{_server.base_url}/v1",
            "api_key": "none",
            "temperature": 0,
            # greedy, a 135M model repeats a phrase inside a JSON string until max_tokens
            "frequency_penalty": 1.0,
            "max_tokens": 256,
            "stream_usage": True,
        }

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict:
        return {"method": "json_schema"}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A long prompt sent twice: the second reads its prefix from the cache."""
        model = self.chat_model_class(**{**self.chat_model_params, "max_tokens": 4})
        text = "Here is a list of numbers to remember: " + ", ".join(str(i) for i in range(400))
        messages = [HumanMessage(text)]
        model.invoke(messages)
        if stream:
            full = None
            for chunk in model.stream(messages):
                full = chunk if full is None else full + chunk
            return full
        return model.invoke(messages)

"""The router's half of prefill/decode disaggregation: prefill a request on a prefill worker and park
its KV span on the decode worker chosen for it. Any failure means: the decode worker prefills
locally, so a request never fails because the prefill side did."""

from __future__ import annotations

import itertools
import logging
from collections import Counter

import aiohttp

from baton.handoff.transport import SPAN_MEDIA_TYPE

logger = logging.getLogger(__name__)


def takes_handoff(endpoint: str, body: dict) -> bool:
    """One prompt, one sequence, no prompt logprobs or echo: what a parked span can serve."""
    prompt = body.get("prompt")
    one_prompt = (
        endpoint == "chat"
        or isinstance(prompt, str)
        or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
    )
    return one_prompt and body.get("n", 1) == 1 and not body.get("logprobs") and not body.get("echo")


class RemotePrefill:
    def __init__(
        self,
        prefill_urls: list[str],
        span_format: str = "grouped",
        kv_secret: str | None = None,
    ) -> None:
        if not prefill_urls:
            raise ValueError("remote prefill needs at least one --prefill worker")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self._next_prefill = itertools.cycle(self.prefill_urls)
        self.span_format = span_format
        self._internal_headers = {"Authorization": f"Bearer {kv_secret}"} if kv_secret else {}
        self.prefills: Counter[str] = Counter({"remote": 0, "local": 0})  # by where
        self.handoff_failures: Counter[str] = Counter({"prefill": 0, "transfer": 0})  # by stage

    async def park(
        self, session: aiohttp.ClientSession, endpoint: str, raw: bytes, body: dict, decode_url: str
    ) -> str | None:
        """The transfer id of a span parked on `decode_url` for this request, or None: prefill there."""
        transfer_id = await self._handoff(session, endpoint, raw, decode_url) if takes_handoff(endpoint, body) else None
        self.prefills["remote" if transfer_id else "local"] += 1
        return transfer_id

    async def _handoff(self, session: aiohttp.ClientSession, endpoint: str, raw: bytes, decode_url: str) -> str | None:
        prefill_url = next(self._next_prefill)
        try:
            async with session.post(
                f"{prefill_url}/v1/internal/prefill",
                params={"endpoint": endpoint, "format": self.span_format},
                data=raw,
                headers={"Content-Type": "application/json", **self._internal_headers},
                timeout=aiohttp.ClientTimeout(total=600),
            ) as r:
                if r.status != 200:
                    self.handoff_failures["prefill"] += 1
                    logger.warning("prefill worker %s answered %d: %s", prefill_url, r.status, (await r.text())[:200])
                    return None
                blob = await r.read()
            async with session.post(
                f"{decode_url}/v1/internal/kv",
                data=blob,
                headers={"Content-Type": SPAN_MEDIA_TYPE, **self._internal_headers},
                timeout=aiohttp.ClientTimeout(total=600),
            ) as r:
                if r.status != 200:
                    self.handoff_failures["transfer"] += 1
                    logger.warning("decode worker %s refused a span: %d", decode_url, r.status)
                    return None
                return (await r.json())["kv_transfer_id"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
            self.handoff_failures["prefill"] += 1
            logger.warning(
                "handoff via %s failed (%s: %s); prefilling on the decode worker", prefill_url, type(e).__name__, e
            )
            return None

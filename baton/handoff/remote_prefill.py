"""The router's half of prefill/decode disaggregation: prefill a request on a prefill worker and park
its KV span on the decode worker chosen for it. Any failure means: the decode worker prefills
locally, so a request never fails because the prefill side did."""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter

import aiohttp

from baton.handoff.transport import SPAN_MEDIA_TYPE
from baton.http import read_bounded

logger = logging.getLogger(__name__)


def takes_handoff(endpoint: str, fields) -> bool:
    """One prompt, one sequence, no logprobs or echo: what a parked span can serve. `fields`: the
    request parsed by the workers' own model (server/protocol.py)."""
    if endpoint == "chat":
        return fields.n == 1 and not fields.logprobs
    prompt = fields.prompt
    one_prompt = isinstance(prompt, str) or (bool(prompt) and all(isinstance(t, int) for t in prompt))
    return one_prompt and fields.n == 1 and fields.logprobs is None and not fields.echo


class RemotePrefill:
    def __init__(
        self,
        prefill_urls: list[str],
        kv_secret: str,
        span_format: str = "grouped",
        max_span_bytes: int = 2 << 30,
        timeout_s: float = 600.0,
    ) -> None:
        if not prefill_urls:
            raise ValueError("remote prefill needs at least one --prefill worker")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self._next_prefill = itertools.cycle(self.prefill_urls)
        self.span_format = span_format
        self.max_span_bytes = max_span_bytes
        self.timeout_s = timeout_s
        self._internal_headers = {"Authorization": f"Bearer {kv_secret}"}
        self.prefills: Counter[str] = Counter({"remote": 0, "local": 0})  # by where
        self.handoff_failures: Counter[str] = Counter({"prefill": 0, "transfer": 0})  # by stage

    async def park(
        self, session: aiohttp.ClientSession, endpoint: str, raw: bytes, fields, decode_url: str
    ) -> str | None:
        """The transfer id of a span parked on `decode_url` for this request, or None: prefill there."""
        transfer_id = None
        if takes_handoff(endpoint, fields):
            transfer_id = await self._handoff(session, endpoint, raw, decode_url)
        self.prefills["remote" if transfer_id else "local"] += 1
        return transfer_id

    async def _handoff(self, session: aiohttp.ClientSession, endpoint: str, raw: bytes, decode_url: str) -> str | None:
        prefill_url = next(self._next_prefill)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with session.post(
                f"{prefill_url}/v1/internal/prefill",
                params={"endpoint": endpoint, "format": self.span_format},
                data=raw,
                headers={"Content-Type": "application/json", **self._internal_headers},
                timeout=timeout,
                allow_redirects=False,
            ) as r:
                if r.status != 200:
                    self.handoff_failures["prefill"] += 1
                    logger.warning("prefill worker %s answered %d", prefill_url, r.status)
                    return None
                blob = await read_bounded(r, self.max_span_bytes, self.timeout_s)
            async with session.post(
                f"{decode_url}/v1/internal/kv",
                data=blob,
                headers={"Content-Type": SPAN_MEDIA_TYPE, **self._internal_headers},
                timeout=timeout,
                allow_redirects=False,
            ) as r:
                if r.status != 200:
                    self.handoff_failures["transfer"] += 1
                    logger.warning("decode worker %s refused a span: %d", decode_url, r.status)
                    return None
                answer = json.loads(await read_bounded(r, 4096, self.timeout_s))
                return answer["kv_transfer_id"] if isinstance(answer, dict) else None
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
            self.handoff_failures["prefill"] += 1
            logger.warning(
                "handoff via %s failed (%s: %s); prefilling on the decode worker", prefill_url, type(e).__name__, e
            )
            return None

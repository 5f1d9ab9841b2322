"""The server a benchmark runs against: minipd (whose mode it can switch and whose timelines and
worker stats it can read), or any other OpenAI-compatible server (one mode, client-side numbers only)."""

from __future__ import annotations

from dataclasses import dataclass

from minipd.bench.server_process import http


class Unreachable(RuntimeError):
    """No OpenAI-compatible server answered at the URL (nothing listens, or something else does)."""


class Lost(ConnectionError):
    """The server stopped answering during the bench."""


class SwitchRefused(RuntimeError):
    """The server answered POST /admin/mode with an error."""


@dataclass(slots=True)
class Target:
    url: str
    model: str
    api_key: str | None = None
    is_minipd: bool = False
    num_workers: int = 1
    max_model_len: int = 8192
    kv_transport: str | None = None

    @classmethod
    def probe(cls, url: str, api_key: str | None = None) -> Target:
        url = url.rstrip("/").removesuffix("/v1")
        t = cls(url, "", api_key)
        try:
            status, models = http("GET", url + "/v1/models", timeout=30, api_key=api_key)
            if status != 200:
                raise Unreachable(f"{url}/v1/models answered {status}: {models}")
            card = models["data"][0]
            t.model = card["id"]
            t.max_model_len = int(card.get("max_model_len") or 8192)
        except OSError as err:  # nothing listens
            raise Unreachable(f"nothing answers there ({getattr(err, 'reason', err)})") from err
        except (ValueError, KeyError, IndexError, TypeError) as err:  # not an OpenAI server
            raise Unreachable(f"{url}/v1/models is not an OpenAI model list ({err!r})") from err
        status, workers = t.get("/admin/workers")
        if status == 200 and isinstance(workers, dict) and "workers" in workers:
            t.is_minipd = True
            t.num_workers = len(workers["workers"])
            t.kv_transport = workers.get("kv_transport")
        return t

    def get(self, path: str):
        return self._call("GET", path)

    def post(self, path: str, body: dict):
        return self._call("POST", path, body)

    def set_mode(self, body: dict) -> dict:
        status, got = self.post("/admin/mode", body)
        if status != 200:
            raise SwitchRefused(f"switching to {body} failed: {got}")
        return got

    def _call(self, method: str, path: str, body: dict | None = None):
        try:
            return http(method, self.url + path, body, timeout=900, api_key=self.api_key)
        except OSError as err:
            raise Lost(f"the server at {self.url} stopped answering ({getattr(err, 'reason', err)})") from err

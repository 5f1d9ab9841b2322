"""What a web page may ask of the server. A browser sends any page's requests to a server on this
machine, so three rules hold by default:

- a page from another site (a foreign Origin, or Sec-Fetch-Site cross-site or same-site when a
  browser sends no Origin) changes nothing, reads nothing under /admin, and uses /v1 only where
  --allowed-origins lists it; CORS headers then say so, as vLLM's --allowed-origins does;
- a body is JSON by its Content-Type: a "simple" text/plain POST needs no preflight (bodies are
  checked in app.py, where they are read);
- bound to loopback, the Host header must name this machine (or an --allowed-hosts entry), which
  is what a DNS-rebinding page cannot fake."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
API_PATHS = ("/v1", "/tokenize", "/detokenize")  # what --allowed-origins opens to other pages (vLLM's API)
OTHER_SITE = ("cross-site", "same-site")  # Sec-Fetch-Site of a request another page made
LOCAL_NAMES = ("localhost", "localhost.localdomain")


def host_name(authority: str) -> str:
    """'[::1]:8000' -> '::1', 'Example.com:80' -> 'example.com'."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1 : authority.find("]")] if "]" in authority else authority
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


def is_loopback(name: str) -> bool:
    if name in LOCAL_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def origin_authority(origin: str) -> tuple[str, str] | None:
    """('http', 'host:port') with the default port made explicit; None for 'null' or garbage."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return parts.scheme, f"{host}:{port or (443 if parts.scheme == 'https' else 80)}"


def with_port(authority: str, scheme: str) -> str:
    authority = authority.strip().lower()
    if authority.endswith("]") or ":" not in authority.rsplit("]", 1)[-1]:
        return f"{authority}:{443 if scheme == 'https' else 80}"
    return authority


@dataclass(slots=True)
class BrowserGuard:
    listen_host: str
    allowed_origins: list[str] = field(default_factory=list)  # "*" allows every origin on /v1
    allowed_hosts: list[str] = field(default_factory=list)  # "*" turns the Host check off

    def host_refusal(self, host_header: str | None) -> str | None:
        """Why this Host header is refused, or None."""
        if host_header is None or "*" in self.allowed_hosts:
            return None  # HTTP/1.0 clients send none; browsers always do
        name = host_name(host_header)
        if name in (h.lower() for h in self.allowed_hosts) or name == self.listen_host.lower():
            return None
        if is_loopback(host_name(self.listen_host)):
            if is_loopback(name):
                return None
        elif not self.allowed_hosts or is_loopback(name) or _is_ip(name):
            return None  # listening on the network: the Host check is opt-in (--allowed-hosts); no IP is rebound
        return (f"the Host header {host_header!r} does not name this server (it listens on {self.listen_host}); "
                "start it with --allowed-hosts to accept that name")  # fmt: skip

    def is_own(self, origin: str, host_header: str | None) -> bool:
        parsed = origin_authority(origin)
        return parsed is not None and host_header is not None and parsed[1] == with_port(host_header, parsed[0])

    def listed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.rstrip("/").lower() in (
            o.rstrip("/").lower() for o in self.allowed_origins
        )

    def origin_refusal(self, method: str, path: str, origin: str | None, host_header: str | None,
                       fetch_site: str | None = None) -> str | None:  # fmt: skip
        """Why a request from this Origin is refused, or None. No Origin and no Sec-Fetch-Site: not a
        browser's call from another page (curl, the openai client, vllm bench)."""
        if origin is not None:
            if self.is_own(origin, host_header):
                return None
        elif fetch_site not in OTHER_SITE:
            return None
        page = origin or f"another site (Sec-Fetch-Site: {fetch_site})"
        if path.startswith(API_PATHS):
            if origin is not None and self.listed(origin) or "*" in self.allowed_origins:
                return None
            return (f"requests from the web page at {page} are not allowed; start the server with "
                    f"--allowed-origins {origin or 'ORIGIN'} to allow them")  # fmt: skip
        if method not in SAFE_METHODS:
            return f"a page from {page} cannot change this server"
        if path.startswith("/admin"):
            return f"a page from {page} cannot read /admin"
        return None

    def cors_headers(self, origin: str | None, path: str) -> dict[str, str]:
        if origin is None or not path.startswith(API_PATHS) or not self.listed(origin):
            return {}
        return {"Access-Control-Allow-Origin": "*" if "*" in self.allowed_origins else origin, "Vary": "Origin"}


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False

"""The API key of this project's HTTP servers (the PRM server ``reward_models.serve`` and the sandbox
server ``envs.sandbox_server``): every request but ``GET /health`` must carry ``Authorization: Bearer
<key>`` (what ``models.remote.ServiceClient`` sends from ``--service_api_key``), compared in constant
time; a server without a key listens on a loopback address only.

It lives at the bottom of the house so that both servers, in their own layers, share it.
"""

from __future__ import annotations

import hmac
import sys
from http.server import BaseHTTPRequestHandler

API_KEY_ENV = "MATHRL_SERVICE_API_KEY"  # models.remote's: the servers stay free of the client's imports
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def check_exposure(host: str, api_key: str | None) -> None:
    """A ``ValueError`` when a server without a key would listen beyond the loopback interface."""
    if api_key is None and host not in LOOPBACK_HOSTS:
        raise ValueError(f"--host={host} without a key would let anyone who can reach {host} use this server: give "
                         f"--api_key (or ${API_KEY_ENV}), or listen on 127.0.0.1")


def authorized(handler: BaseHTTPRequestHandler, expected: str | None, max_body_bytes: int) -> bool:
    """Whether ``handler``'s request carries the key ``expected`` (always, on a server without one); if
    not, answers 401 saying whether the key was missing or wrong (``handler.reply(status, payload,
    headers)``), logs that on stderr (never the key), and closes the connection after reading a body of
    at most ``max_body_bytes`` (a client still sending would see a reset, not the 401)."""
    if expected is None:
        return True
    scheme, _, token = handler.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected.encode()):
        return True
    problem = "a wrong API key" if scheme.lower() == "bearer" and token.strip() else "no API key"
    print(f"refused {handler.command} {handler.path.split('?')[0]} from {handler.client_address[0]}: {problem}",
          file=sys.stderr, flush=True)
    length = handler.headers.get("Content-Length", "")
    if length.isascii() and length.isdigit() and int(length) <= max_body_bytes:
        handler.rfile.read(int(length))
    handler.close_connection = True
    handler.reply(401, {"error": f"this server needs its API key and the request carried {problem}: send "
                                 f"'Authorization: Bearer <key>' (mathrl: --service_api_key or ${API_KEY_ENV})"},
                  {"WWW-Authenticate": "Bearer"})
    return False

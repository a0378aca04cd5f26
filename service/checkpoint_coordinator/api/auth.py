"""Bearer-token checks. Admin token from configuration; run tokens stored hashed.

A run token reaches only its own run. An unknown run and a wrong token answer the same 403, so a
caller cannot learn whether a run exists.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..errors import Forbidden, Unauthorized
from ..ledger.runs import run_token_valid
from .common import RUN_ID_PATTERN

_bearer = HTTPBearer(auto_error=False, description="Admin token or the run's own token")


def _token(creds: HTTPAuthorizationCredentials | None) -> str:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise Unauthorized("send 'Authorization: Bearer <token>'")
    return creds.credentials


def _is_admin(request: Request, token: str) -> bool:
    admin = request.app.state.settings.admin_token
    if admin is None:
        return False
    return hmac.compare_digest(token.encode(), admin.get_secret_value().encode())


@dataclass(frozen=True)
class Caller:
    admin: bool
    run_id: str | None


async def require_admin(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> Caller:
    token = _token(creds)
    if not _is_admin(request, token):
        raise Forbidden("this route needs the admin token")
    return Caller(admin=True, run_id=None)


async def require_run_access(
    request: Request,
    run_id: str = Path(..., pattern=RUN_ID_PATTERN, max_length=128),
    creds: HTTPAuthorizationCredentials | None = Depends(_bearer),
) -> Caller:
    token = _token(creds)
    if _is_admin(request, token):
        return Caller(admin=True, run_id=run_id)
    settings = request.app.state.settings
    if not await run_token_valid(request.app.state.engine, run_id, token, cache_s=settings.run_token_cache_s):
        raise Forbidden("token does not grant access to this run")
    return Caller(admin=False, run_id=run_id)

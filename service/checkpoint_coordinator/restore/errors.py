"""Typed refusals of Gym registration, restore and ledger import (stable codes, problem+json)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import BadRequest, Conflict, CoordinatorError, NotFound
from ..gym.errors import FailureClass, GymControlError

# Failure class of a Gym control error -> (HTTP status, problem code).
_GYM_STATUS: dict[FailureClass, tuple[int, str]] = {
    FailureClass.CONFIG_ERROR: (422, "gym_config_error"),
    FailureClass.CHECKPOINT_STATE: (422, "gym_checkpoint_state"),
    FailureClass.TOPOLOGY_MISMATCH: (409, "gym_topology_mismatch"),
    FailureClass.CONFLICT: (409, "gym_conflict"),
    FailureClass.PROTOCOL_ERROR: (502, "gym_protocol_error"),
    FailureClass.UNAVAILABLE: (502, "gym_unavailable"),
    FailureClass.NOT_READY: (502, "gym_unavailable"),
    FailureClass.LEASE_LOST: (502, "gym_unavailable"),
    FailureClass.DRAIN_TIMEOUT: (502, "gym_unavailable"),
}


def named_servers(exc: GymControlError) -> list[str]:
    """``<instance_id>/<server_name>`` of every server a failure names (``*``: the instance)."""
    return sorted(f"{iid}/{server}" for iid, servers in exc.instances.items() for server in servers)


class GymFailure(CoordinatorError):
    """A Gym control failure, naming the instances and servers that caused it."""

    title = "Gym control failure"

    @classmethod
    def of(cls, exc: GymControlError, what: str, urls: Mapping[str, Mapping[str, str]] | None = None) -> GymFailure:
        """``urls``: the base URL of each server, per instance, so the message names where each
        failing call went."""
        status, code = _GYM_STATUS.get(exc.failure_class, (502, "gym_unavailable"))
        servers = named_servers(exc)
        return cls(
            f"{what} failed: {exc.failure_class}: {_server_lines(exc, urls or {})}",
            code=code,
            status=status,
            servers=servers,
            failure=exc.to_dict(),
        )


def _server_lines(exc: GymControlError, urls: Mapping[str, Mapping[str, str]]) -> str:
    """What each failing server answered (10 at most), with its URL; a 401 says which token to
    fix."""
    parts = [(iid, server, part) for iid, servers in sorted(exc.instances.items()) for server, part in sorted(servers.items())]
    said = []
    for iid, server, part in parts[:10]:
        url = urls.get(iid, {}).get(server)
        where = f"{iid}/{server}" + (f" at {url}" if url else "")
        answer = f"HTTP {part['http_status']}" if part.get("http_status") else "no answer"
        code = f" {part['code']}" if part.get("code") else ""
        text = " ".join(str(part.get("detail") or "").split())[:200]
        said.append(f"{where}: {answer}{code}" + (f" ({text})" if text else ""))
    if len(parts) > 10:
        said.append(f"and {len(parts) - 10} more")
    if any(part.get("http_status") == 401 for _, _, part in parts):
        said.append("Gym answered 401: the control_token is not the instance's checkpoint.control_auth_token")
    return "; ".join(said) or exc.message


# The refusals, one a line: the class, its stable code, (HTTP status,) title.
class EgressRefusedProblem(CoordinatorError): code, status, title = "gym_egress_refused", 422, "A Gym server's address is not one the coordinator may reach"
class RestartOnlyRefused(CoordinatorError): code, status, title = "restart_only_gym_servers", 422, "Restart-only Gym servers under turn-level recovery"
class SnapshotNotFound(NotFound): code, title = "snapshot_not_found", "No such published snapshot"
class NoCompatibleSnapshot(NotFound): code, title = "no_compatible_snapshot", "No published snapshot is compatible with the trainer's step"
class GymManifestAbsent(NotFound): code, title = "gym_manifest_absent", "The snapshot has no Gym manifest"
class TopologyDiffers(Conflict): code, title = "gym_topology_mismatch", "Live Gym topology differs from the snapshot's"
class InstanceMapInvalid(CoordinatorError): code, status, title = "instance_map_invalid", 422, "The instance map is not a one-to-one map"
class InstanceMapUnknown(Conflict): code, title = "instance_map_unknown_instance", "The instance map names an instance the restore does not know"
class ManifestDisagrees(Conflict): code, title = "gym_manifest_disagrees_with_ledger", "The Gym manifest disagrees with the ledger cut"
class GymNotFresh(Conflict): code, title = "gym_not_fresh", "Gym instances are not freshly started"
class RestoreConflict(Conflict): code, title = "restore_conflict", "Restore id reused with a different request"
class RestoreInProgress(Conflict): code, title = "restore_in_progress", "A restore of this run is in progress"
class RestoreNotApplied(Conflict): code, title = "restore_not_applied", "The restore has no rows: it was not applied"
class SnapshotUnusable(Conflict): code, title = "snapshot_unusable", "The snapshot cannot be restored"
class LedgerImportRefused(BadRequest): code, title = "legacy_ledger_invalid", "NeMo RL ledger refused"
class SnapshotExists(Conflict): code, title = "snapshot_exists", "A snapshot with this id already exists"


class RestoreRefusedEarlier(CoordinatorError):
    """A repeat of a restore that was refused after Gym had been touched: same answer again."""

    title = "Restore refused"

    def __init__(self, problem: dict[str, Any]) -> None:
        extra = {k: v for k, v in problem.items() if k not in ("type", "title", "status", "code", "detail")}
        super().__init__(str(problem.get("detail", "restore refused")), code=str(problem.get("code", "restore_refused")), status=int(problem.get("status", 409)), **extra)
        self.title = str(problem.get("title", self.title))

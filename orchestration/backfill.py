"""`shardprep backfill`: launch an asset backfill in a running Dagster instance through its
webserver's GraphQL API (what the UI's "Materialize" dialog does), so the daemon runs it with each
asset's BackfillPolicy and it shows in the UI's backfill list."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from shardprep.errors import ShardprepError

DEFAULT_URL = "http://127.0.0.1:3000"

ASSET_NODES = """
query AssetNodes($withStatuses: Boolean!) {
  assetNodes {
    assetKey { path }
    isMaterializable
    isPartitioned
    partitionKeys
    assetPartitionStatuses @include(if: $withStatuses) {
      __typename
      ... on DefaultPartitionStatuses { materializedPartitions materializingPartitions }
    }
  }
}
"""

LAUNCH = """
mutation Launch($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on Error { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}
"""


class BackfillError(ShardprepError, RuntimeError):
    """The backfill could not be launched (webserver down, unknown asset or partition, refused)."""


@dataclass(frozen=True)
class Backfill:
    backfill_id: str
    assets: list[str]
    partitions: list[str]  # empty: only unpartitioned assets


def graphql(url: str, query: str, variables: dict | None = None, timeout: float = 30.0) -> dict:
    """POST one GraphQL request to ``{url}/graphql``; returns ``data``. Raises BackfillError naming the
    URL when nothing answers there, or what the server said when it refuses."""
    endpoint = url.rstrip("/") + "/graphql"
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    request = urllib.request.Request(endpoint, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise BackfillError(f"the Dagster webserver at {url} answered HTTP {e.code} to {endpoint}: "
                            f"{e.read()[:300].decode(errors='replace')}") from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise BackfillError(f"no Dagster webserver answers at {url} ({reason}); start it with `make ui` "
                            "or pass --url") from e
    except json.JSONDecodeError as e:
        raise BackfillError(f"{endpoint} did not answer with JSON: is {url} a Dagster webserver?") from e
    if payload.get("errors"):
        raise BackfillError(f"GraphQL error from {url}: " + "; ".join(e.get("message", str(e))
                                                                      for e in payload["errors"]))
    return payload["data"]


def _name(node: dict) -> str:
    return "/".join(node["assetKey"]["path"])


def plan(nodes: list[dict], selection: str, partitions: list[str] | None,
         all_missing: bool) -> tuple[list[dict], list[str]]:
    """The asset nodes a selection names and the partitions to backfill.

    ``selection``: comma-separated asset names (``a/b`` for a multi-part key) or ``*`` for every
    materializable asset. ``all_missing``: every partition that any selected partitioned asset has
    neither materialized nor in progress."""
    materializable = {_name(n): n for n in nodes if n["isMaterializable"]}
    if selection.strip() == "*":
        chosen = list(materializable.values())
    else:
        names = [s.strip() for s in selection.split(",") if s.strip()]
        unknown = [n for n in names if n not in materializable]
        if unknown or not names:
            raise BackfillError(f"unknown asset(s) {', '.join(unknown) or '(none given)'}; the instance has: "
                                + ", ".join(sorted(materializable)))
        chosen = [materializable[n] for n in names]
    partitioned = [n for n in chosen if n["isPartitioned"]]
    if not partitioned:
        if partitions:
            raise BackfillError(f"{', '.join(_name(n) for n in chosen)} are not partitioned: drop --partitions")
        return chosen, []
    known = set().union(*(n["partitionKeys"] for n in partitioned))
    if partitions is not None:
        unknown = [p for p in partitions if p not in known]
        if unknown or not partitions:
            raise BackfillError(f"unknown partition(s) {', '.join(unknown) or '(none given)'}; "
                                f"{len(known)} shard(s) are registered")
        return chosen, partitions
    if not all_missing:
        raise BackfillError("say which partitions: --partitions A,B or --all-missing")
    order = [k for n in partitioned for k in n["partitionKeys"]]
    missing: set[str] = set()
    for n in partitioned:
        statuses = n.get("assetPartitionStatuses") or {}
        done = set(statuses.get("materializedPartitions", [])) | set(statuses.get("materializingPartitions", []))
        missing |= set(n["partitionKeys"]) - done
    return chosen, [k for k in dict.fromkeys(order) if k in missing]


def launch_backfill(url: str, selection: str, partitions: list[str] | None = None, all_missing: bool = False,
                    title: str | None = None) -> Backfill | None:
    """Launch one asset backfill of ``selection`` over ``partitions`` (or every missing one). Returns
    None when --all-missing finds nothing missing."""
    # partition statuses only when needed: they cost the server a scan per asset
    nodes = graphql(url, ASSET_NODES, {"withStatuses": all_missing})["assetNodes"]
    chosen, keys = plan(nodes, selection, partitions, all_missing)
    if all_missing and not keys and any(n["isPartitioned"] for n in chosen):
        return None
    params: dict = {"assetSelection": [{"path": n["assetKey"]["path"]} for n in chosen],
                    "title": title or "shardprep backfill"}
    if keys:
        params["partitionNames"] = keys
    else:
        params["allPartitions"] = True  # only unpartitioned assets: one materialization each
    result = graphql(url, LAUNCH, {"params": params})["launchPartitionBackfill"]
    if result["__typename"] != "LaunchBackfillSuccess":
        detail = result.get("message") or "; ".join(e["message"] for e in result.get("errors", []))
        raise BackfillError(f"the webserver refused the backfill ({result['__typename']}): {detail}")
    return Backfill(result["backfillId"], [_name(n) for n in chosen], keys)

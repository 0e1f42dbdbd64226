"""dataset_report: one HTML page over every shard (success rates, failures, sizes, captions, norms)."""

import dagster as dg

from shardprep.report.page import write_report
from shardprep_dagster.assets.shard_runs import failures_table, from_record, versioned
from shardprep_dagster.resources.dataset import DatasetResource


def _summary_markdown(totals: dict, html_path: str) -> str:
    rows = [f"| {k.replace('_', ' ')} | {f'{v:.2%}' if k == 'success_rate' else v} |"
            for k, v in totals.items() if v is not None]
    return "\n".join(["| | |", "|---|---:|", *rows, "", f"Full report: `{html_path}`"])


@dg.asset(
    **from_record("dataset_report"),
    kinds={"html"},
    # hourly, once shards or embeddings changed since the last tick (or on demand from the UI)
    automation_condition=dg.AutomationCondition.on_cron("0 * * * *"),
)
def dataset_report(context: dg.AssetExecutionContext, dataset: DatasetResource) -> dg.MaterializeResult:
    """``<root>/report/index.html``: a self-contained page with the success rate per shard, failures
    by reason, original image sizes, caption lengths, CLIP embedding norms and a per-shard table; with
    video shards, their videos, clips and clip durations."""
    layout = dataset.layout
    data = write_report(layout, cfg=dataset.config)  # broken outputs listed as `shardprep verify` finds them
    totals = data.totals
    for problem in data.problems:
        context.log.warning(problem)
    context.log.info(f"report over {totals['shards']} shards written to {layout.report_html}")
    metadata = {k: v for k, v in totals.items() if v is not None}
    if data.videos:  # clip counts and durations beside the image figures
        metadata.update({k if k.startswith(("video", "clip")) else f"video_{k}": v
                         for k, v in data.video_totals.items()})
    return versioned(dataset, "dataset_report", dg.MaterializeResult(metadata={
        **metadata,
        "report": dg.MetadataValue.path(layout.report_html),
        "summary": dg.MetadataValue.md(_summary_markdown(totals, layout.report_html)),
        "failures_by_reason": failures_table(dict(data.failures_by_reason)),
        "unreadable_files": len(data.problems),
        "dagster/row_count": totals["successes"],
    }))

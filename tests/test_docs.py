"""The README documents every config field and every environment setting (a new one without a line fails)."""

from dataclasses import fields

from shardprep.config import DatasetConfig
from shardprep_dagster.resources.settings import Settings, env_name
from tests.fixtures.configs import CHECKOUT


def test_readme_lists_every_config_field_and_setting():
    readme = (CHECKOUT / "README.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in readme.splitlines() if line.startswith("| `")}
    assert set(DatasetConfig.model_fields) - rows == set()
    assert {env_name(f.name) for f in fields(Settings)} - rows == set()

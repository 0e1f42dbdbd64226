"""The HTML dataset report (``page``) and its curation section (``curation``), their shared HTML and plot
helpers (``html``), and a shard's thumbnail sheet for the UI (``contact_sheet``)."""

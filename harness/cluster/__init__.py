"""An emulated multi-node cluster: network namespaces joined by shaped links (``netns``), the
driver that runs a job across them (``launch``) and the table of such runs (``table``)."""

"""An emulated multi-node cluster: network namespaces joined by shaped links (``netns``), the
driver that runs a job across them (``emulated``) and a rank there (``worker``); the table of
such runs is ``bcastbench emulated-table`` (``harness.commands.emulated_table``)."""

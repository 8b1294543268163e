"""An example of a strategy that lives outside bcastbench (see ``per_key``)."""

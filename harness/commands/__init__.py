"""The commands, the top layer: ``bcastbench``'s verbs and their targets (``cli`` dispatches by
module name, so ``bcastbench --help`` imports none of them), each a module with ``main(argv)``.

Below them, in the order imports may go (pyproject's ``[tool.importlinter]``): the report, the
job (``harness.job``), its worlds (``harness.worlds``) and batches (``harness.payload``), the cost model's
pricing (``harness.model``), the utilities, and the strategies.
"""

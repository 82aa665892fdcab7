"""The experiment harness: runs an experiment's grid of systems × tasks and writes its results under results/.

Rooms (each package's docstring says more):
- running/       config and typed params, the grid of cells, cells and the store on disk, the workspace, the one
                 driver every experiment runs through (`python -m harness +exp=NAME` -> running.driver.run)
- measuring/     load generation, CPU accounting, teacher-forced fidelity, timed offline calls, servers
- reporting/     statistics with intervals, tables, plots, the summary writer, README blocks, rebuilds from disk
- integrations/  lm-eval's CLI, the embedded model assets, a ready OpenAI server
- experiments/   one module per experiment kind, or one package holding a kind and its own helpers

Doors: `python -m harness` (run) and `python -m harness.report EXP` (rebuild a summary from the cells on disk).
"""

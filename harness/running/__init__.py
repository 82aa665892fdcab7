"""Running an experiment: config schema and typed params, the grid of cells, cells and results on disk, the driver."""

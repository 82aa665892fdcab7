"""Reporting: statistics with intervals, tables, plots, the summary writer and the README blocks built from them."""

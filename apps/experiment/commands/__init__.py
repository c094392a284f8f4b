"""One module per subcommand of gc.py: run, sweep (with max-batch), ablate, plot."""

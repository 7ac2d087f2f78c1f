"""The model-side ``captioner`` subcommands (data, train, eval, caption, export, ...)."""

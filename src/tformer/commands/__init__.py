"""The functions behind `tformer <command>`; `tformer.cli` turns each signature into its command line."""

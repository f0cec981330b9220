"""Entry points people run: the `trellis` command and the scripted demo."""

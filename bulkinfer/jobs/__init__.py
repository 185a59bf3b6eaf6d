"""The commands' wiring: run, plan, calibrate, eval; a page each."""

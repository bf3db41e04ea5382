"""An engine's life around the step loop: start-up (construct, warm up, calibrate, mark ready), and the
headless ranks of an engine spanning several."""

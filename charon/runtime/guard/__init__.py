"""What stops a function and records the decision: the watchdog and its budgets, interrupts that land only in
user code, the quarantine of process-killing transactions, and the verdicts (dead letters) they leave; shared by
every engine."""

"""Scheduling one engine's steps: the scheduler, its step plan (`schedule`), the waiting queue and its policies,
the step's token budget and the elastic tiers' share of it, the hot window of a long prompt, decode cadence,
KV reservations, stage passes and the online step-time fit the time model reads."""

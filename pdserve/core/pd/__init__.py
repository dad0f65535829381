"""Prefill/decode disaggregation's decisions, torch-free so both clocks run them: delivery order and water
levels, production pace, which blocks a prefill step pushes, and the decode worker's books (reservations,
grants, settlement, consumption)."""

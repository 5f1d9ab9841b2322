"""The teaching demo: the interference stall, live, from the real engine."""

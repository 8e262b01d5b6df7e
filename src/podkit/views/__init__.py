"""What a person reads of the pod: `podkit status`, `podkit doctor` and its bundle, the /metrics endpoint and the page,
all drawn from the same records and standing."""

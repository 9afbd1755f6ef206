"""pagefleet: LLM serving engine, router and operator."""

"""Protocol-free types shared by the API dialects and the runtime."""

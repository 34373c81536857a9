"""Contract tests: megarl's SGLang requests, launch commands and update sequences through SGLang's own code."""

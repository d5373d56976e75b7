from .engine import Finding
from .verify import Report, VerificationError, check_or_raise, verify

__all__ = ["Finding", "Report", "VerificationError", "check_or_raise", "verify"]

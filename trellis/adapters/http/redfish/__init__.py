"""Trellis as a Redfish service (ARCHITECTURE §11, northbound; docs/redfish.md)."""

from trellis.adapters.http.redfish.accounts import AccountStore, admin_password
from trellis.adapters.http.redfish.service import RedfishService

__all__ = ["AccountStore", "RedfishService", "admin_password"]

"""The Redfish fabric driver: Trellis as a client of a fabric manager that speaks Redfish
(ARCHITECTURE §11, "Southbound"; docs/fabric-drivers.md)."""

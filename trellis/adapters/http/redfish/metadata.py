"""`/redfish/v1/$metadata`: the CSDL document naming every schema this service's resources use
(DSP0266 §8.4). Its references name DMTF's published schema files; a validator run offline is
given a local copy of them (third_party/dmtf/redfish-csdl/, DMTF schema release 2025.4)."""

from __future__ import annotations

#: Schema file -> the versioned namespaces of it that the service's payloads name.
SCHEMAS: dict[str, tuple[str, ...]] = {
    "ServiceRoot": ("ServiceRoot.v1_20_0",),
    "ComputerSystemCollection": (),
    "ComputerSystem": ("ComputerSystem.v1_27_0",),
    "CompositionService": ("CompositionService.v1_2_3",),
    "CompositionReservation": ("CompositionReservation.v1_0_2",),
    "CompositionReservationCollection": (),
    "ResourceBlockCollection": (),
    "ResourceBlock": ("ResourceBlock.v1_4_3",),
    "ZoneCollection": (),
    "Zone": ("Zone.v1_6_3",),
    "FabricCollection": (),
    "Fabric": ("Fabric.v1_4_0",),
    "SwitchCollection": (),
    "Switch": ("Switch.v1_11_0",),
    "PortCollection": (),
    "Port": ("Port.v1_18_0",),
    "EndpointCollection": (),
    "Endpoint": ("Endpoint.v1_8_2",),
    "ConnectionCollection": (),
    "Connection": ("Connection.v1_4_0",),
    "ProcessorCollection": (),
    "Processor": ("Processor.v1_22_0",),
    "MemoryCollection": (),
    "Memory": ("Memory.v1_23_0",),
    "Drive": ("Drive.v1_22_0",),
    "NetworkInterface": ("NetworkInterface.v1_2_3",),
    "AccountService": ("AccountService.v1_18_1",),
    "ManagerAccountCollection": (),
    "ManagerAccount": ("ManagerAccount.v1_14_1",),
    "RoleCollection": (),
    "Role": ("Role.v1_3_3",),
    "SessionService": ("SessionService.v1_2_0",),
    "SessionCollection": (),
    "Session": ("Session.v1_8_0",),
    "EventService": ("EventService.v1_12_0",),
    "Event": ("Event.v1_11_0",),
    "CollectionCapabilities": ("CollectionCapabilities.v1_4_1",),
    "Message": ("Message.v1_3_0",),
    "Resource": ("Resource.v1_23_0",),
}


def metadata_xml() -> bytes:
    refs = []
    for name, versions in SCHEMAS.items():
        includes = [] if name == "CollectionCapabilities" else [name]
        includes += versions
        lines = "".join(f'\n    <edmx:Include Namespace="{ns}"/>' for ns in includes)
        refs.append(
            f'  <edmx:Reference Uri="http://redfish.dmtf.org/schemas/v1/{name}_v1.xml">'
            f"{lines}\n  </edmx:Reference>\n"
        )
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<edmx:Edmx xmlns:edmx="http://docs.oasis-open.org/odata/ns/edmx" Version="4.0">\n'
        + "".join(refs)
        + '  <edmx:Reference Uri="http://redfish.dmtf.org/schemas/v1/RedfishExtensions_v1.xml">\n'
        '    <edmx:Include Namespace="RedfishExtensions.v1_0_0" Alias="Redfish"/>\n'
        "  </edmx:Reference>\n"
        "  <edmx:DataServices>\n"
        '    <Schema xmlns="http://docs.oasis-open.org/odata/ns/edm" Namespace="Service">\n'
        '      <EntityContainer Name="Service" Extends="ServiceRoot.v1_20_0.ServiceContainer"/>\n'
        "    </Schema>\n"
        "  </edmx:DataServices>\n"
        "</edmx:Edmx>\n"
    ).encode()

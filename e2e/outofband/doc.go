// Package outofband holds end-to-end tests of out-of-band power: a static
// inventory whose machines have BMCs, the static provider built from it,
// and power.Controller calls through real BMCs (OpenIPMI's ipmi_sim and the
// TLS Redfish fake) that really stop and start the machines (sshtest
// Machines: real OpenSSH servers with a detached "agent" process). A
// machine powered off refuses SSH and has lost its agent; powered on, it
// answers again with its pinned host key.
//
// These tests live apart from package e2e because they need neither the
// shepherd binaries nor a database, which e2e's harness builds and starts.
package outofband

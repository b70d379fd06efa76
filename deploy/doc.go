// Package deploy holds what operators deploy Shepherd with, none of it Go:
// systemd units for `shepherd run` (systemd/), an example environment file
// and provider configurations (examples/), Prometheus alerting rules with
// their unit tests (prometheus/) and a Grafana dashboard of the fleet
// gauges (grafana/). Its tests check them with the tools that read them
// (systemd-analyze, promtool) and against a running shepherd.
package deploy

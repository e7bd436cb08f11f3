package main

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Every component has a name of its own: two that shared one would share a
// log field, a panics series and a drain step, and nobody could tell them
// apart. A gating heartbeat needs a heartbeat, and the heartbeat workers
// keep the names other instances read in Redis (docs/redis-keys.md).
func TestComponentsHaveOneNameEach(t *testing.T) {
	names := map[string]component{}
	var workers []string
	for c := range numComponents {
		spec := c.spec()
		if spec.name == "" {
			t.Errorf("component %d has no name", int(c))
			continue
		}
		if other, ok := names[spec.name]; ok {
			t.Errorf("components %d and %d are both named %q", int(other), int(c), spec.name)
		}
		names[spec.name] = c
		if c.String() != spec.name {
			t.Errorf("component %d says %q, its name is %q", int(c), c.String(), spec.name)
		}
		if spec.gates && spec.heartbeat == "" {
			t.Errorf("%s gates readiness on a heartbeat it does not write", c)
		}
		if spec.heartbeat != "" {
			workers = append(workers, spec.heartbeat)
		}
	}
	slices.Sort(workers)
	if want := []string{"jobs", "outbox", "scheduler"}; !slices.Equal(workers, want) {
		t.Errorf("heartbeat workers %q, want %q: other instances read these keys", workers, want)
	}
	if got, want := numComponents.String(), fmt.Sprintf("component(%d)", int(numComponents)); got != want {
		t.Errorf("an unknown component says %q, want %q", got, want)
	}
}

// Right after newMetrics and the blocks' (as newApp makes them), every component's panics series, every connecting
// component's connect series and every beating component's heartbeat series
// exist at 0, so increase(...) sees their first event; and those counters
// have no other series, which would be a name kept in step by hand.
func TestComponentSeriesStartAtZero(t *testing.T) {
	want := componentSeries()
	m := newMetrics()
	newBlockMetrics(m.registry)
	got := gatherComponentSeries(t, m.registry)
	for key, v := range got {
		if !want[key] {
			t.Errorf("%s belongs to no component", key)
		} else if v != 0 {
			t.Errorf("%s = %v after newMetrics, want 0", key, v)
		}
	}
	for key := range want {
		if _, ok := got[key]; !ok {
			t.Errorf("no series %s after newMetrics", key)
		}
	}
}

// componentSeries is every panics, connect and heartbeat series the
// component table asks for, as "name{label=value,...}".
func componentSeries() map[string]bool {
	want := map[string]bool{}
	for c := range numComponents {
		spec := c.spec()
		want["kumiko_panics_total{component="+spec.name+"}"] = true
		for _, r := range []string{"failed", "ok"} {
			if spec.connects {
				want["kumiko_connect_attempts_total{result="+r+",target="+spec.name+"}"] = true
			}
			if spec.heartbeat != "" {
				want["kumiko_worker_heartbeats_total{result="+r+",worker="+spec.heartbeat+"}"] = true
			}
		}
	}
	return want
}

// gatherComponentSeries is every series of the panics, connect and heartbeat
// counters in reg, keyed like componentSeries, with its value.
func gatherComponentSeries(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		switch f.GetName() {
		case "kumiko_panics_total", "kumiko_connect_attempts_total", "kumiko_worker_heartbeats_total":
		default:
			continue
		}
		for _, s := range f.GetMetric() {
			pairs := make([]string, len(s.GetLabel()))
			for i, l := range s.GetLabel() { // Gather sorts them by name
				pairs[i] = l.GetName() + "=" + l.GetValue()
			}
			got[f.GetName()+"{"+strings.Join(pairs, ",")+"}"] = s.GetCounter().GetValue()
		}
	}
	return got
}

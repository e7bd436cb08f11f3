package main

import (
	"fmt"
	"go/ast"
	"go/token"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// processComponents is every component of the process: the core's and the
// blocks' (the root lists those).
func processComponents() []component { return slices.Concat(coreComponents(), blockComponents()) }

// Every component has a name of its own: two that shared one would share a
// log field, a panics series and a drain step, and nobody could tell them
// apart. A gating heartbeat needs a heartbeat, and the heartbeat workers
// keep the names other instances read in Redis (docs/redis-keys.md). Every
// component declared in the package is listed (coreComponents,
// blockComponents), or its series would not start at 0.
func TestComponentsHaveOneNameEach(t *testing.T) {
	names := map[string]bool{}
	var workers []string
	for _, c := range processComponents() {
		if c.name == "" {
			t.Errorf("a component has no name: %+v", c)
			continue
		}
		if names[c.name] {
			t.Errorf("two components are named %q", c.name)
		}
		names[c.name] = true
		if c.gates && c.heartbeat == "" {
			t.Errorf("%s gates readiness on a heartbeat it does not write", c)
		}
		if c.heartbeat != "" {
			workers = append(workers, c.heartbeat)
		}
	}
	slices.Sort(workers)
	if want := []string{"jobs", "outbox", "scheduler"}; !slices.Equal(workers, want) {
		t.Errorf("heartbeat workers %q, want %q: other instances read these keys", workers, want)
	}
	for name, file := range declaredComponents(t) {
		if !names[name] {
			t.Errorf("component %q (%s) is in neither coreComponents (components.go) nor blockComponents (app.go)", name, file)
		}
	}
}

// declaredComponents reads the package's source for every component{name: …}
// declared at package level: its name and its file.
func declaredComponents(t *testing.T) map[string]string {
	t.Helper()
	found := map[string]string{}
	for file, f := range parseSources(t, ".") {
		for _, decl := range f.Decls {
			gen, ok := decl.(*ast.GenDecl)
			if !ok || gen.Tok != token.VAR {
				continue
			}
			for _, spec := range gen.Specs {
				for _, v := range spec.(*ast.ValueSpec).Values {
					lit, ok := v.(*ast.CompositeLit)
					if !ok {
						continue
					}
					if typ, ok := lit.Type.(*ast.Ident); !ok || typ.Name != "component" {
						continue
					}
					for _, e := range lit.Elts {
						if kv, ok := e.(*ast.KeyValueExpr); ok && fmt.Sprint(kv.Key) == "name" {
							name, _ := strconv.Unquote(kv.Value.(*ast.BasicLit).Value)
							found[name] = file
						}
					}
				}
			}
		}
	}
	return found
}

// Right after newMetrics and the blocks' (as newApp makes them), every component's panics series, every connecting
// component's connect series and every beating component's heartbeat series
// exist at 0, so increase(...) sees their first event; and those counters
// have no other series, which would be a name kept in step by hand.
func TestComponentSeriesStartAtZero(t *testing.T) {
	want := componentSeries()
	m := newMetrics()
	newBlockMetrics(m)
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
	for _, c := range processComponents() {
		want["kumiko_panics_total{component="+c.name+"}"] = true
		for _, r := range []string{"failed", "ok"} {
			if c.connects {
				want["kumiko_connect_attempts_total{result="+r+",target="+c.name+"}"] = true
			}
			if c.heartbeat != "" {
				want["kumiko_worker_heartbeats_total{result="+r+",worker="+c.heartbeat+"}"] = true
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

package main

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"path"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"
)

// goroutineDump is every goroutine's stack with its pprof labels, as
// GET /debug/pprof/goroutine?debug=1 shows them: goroutines with the same
// stack and labels are one record, "N @ …", then "# labels: {…}", then one
// "#\t0x…\tfunc+0x…\tfile:line" line per frame. Unlike debug=2 (a panic's
// format) it shows labels without GODEBUG=tracebacklabels=1.
type goroutineDump struct {
	at   time.Time // zero: no dump
	text []byte
}

// takeGoroutines dumps every goroutine now.
func takeGoroutines() goroutineDump {
	var b bytes.Buffer
	pprof.Lookup("goroutine").WriteTo(&b, 1) // writes to memory: cannot fail
	return goroutineDump{at: time.Now(), text: b.Bytes()}
}

// watchGoroutines looks at the goroutines while a step runs: stallFirstLook
// after it began, then at doubling intervals, keeping the last look; stop
// ends the watch and returns that look (none when the step was quick).
// A step that fails or overruns is then explained by the stacks it was stuck
// in: a call cut short by its deadline has returned by the time its error
// is seen, and a dump taken then shows nothing stuck.
//
// The watcher has ctx's labels, not the step's: it is no part of the step.
func watchGoroutines(ctx context.Context) (stop func() goroutineDump) {
	quit, done := make(chan struct{}), make(chan struct{})
	var last goroutineDump
	go func() {
		defer close(done)
		pprof.SetGoroutineLabels(ctx)
		wait := time.NewTimer(stallFirstLook)
		defer wait.Stop()
		for next := stallFirstLook; ; next *= 2 {
			select {
			case <-quit:
				return
			case <-wait.C:
			}
			last = takeGoroutines()
			wait.Reset(next)
		}
	}()
	return func() goroutineDump {
		close(quit)
		<-done
		return last
	}
}

// goroutineGroup is one record of a dump: count goroutines with the same
// labels and stack, innermost frame first.
type goroutineGroup struct {
	count  int
	labels map[string]string
	frames []string // "func (file.go:line)"
}

// groups reads the dump's records.
func (d goroutineDump) groups() []goroutineGroup {
	var out []goroutineGroup
	for record := range strings.SplitSeq(string(d.text), "\n\n") {
		var g goroutineGroup
		for line := range strings.SplitSeq(strings.TrimSpace(record), "\n") {
			switch {
			case !strings.HasPrefix(line, "#"):
				// "N @ 0x… 0x…"; the first record also has the profile's header line before it.
				if n, _, ok := strings.Cut(line, " @ "); ok {
					g.count, _ = strconv.Atoi(n)
				}
			case strings.HasPrefix(line, "# labels: "):
				g.labels = parseLabels(strings.TrimPrefix(line, "# labels: "))
			case strings.HasPrefix(line, "#\t"):
				// #	0x4b6f90	main.handleSlow.func1+0x90		/src/drain_demo.go:47
				fields := strings.Fields(line)
				if len(fields) < 4 {
					continue
				}
				fn, _, _ := strings.Cut(fields[2], "+0x")
				g.frames = append(g.frames, fmt.Sprintf("%s (%s)", fn, path.Base(fields[3])))
			}
		}
		if g.count > 0 {
			out = append(out, g)
		}
	}
	return out
}

// parseLabels reads `{"key":"value", "k2":"v2"}`, the form a dump prints
// a goroutine's labels in.
func parseLabels(s string) map[string]string {
	labels := map[string]string{}
	s = strings.TrimSuffix(strings.TrimPrefix(s, "{"), "}")
	for s != "" {
		key, err := strconv.QuotedPrefix(s)
		if err != nil {
			break
		}
		s = strings.TrimPrefix(s[len(key):], ":")
		value, err := strconv.QuotedPrefix(s)
		if err != nil {
			break
		}
		s = strings.TrimPrefix(s[len(value):], ", ")
		k, _ := strconv.Unquote(key)
		v, _ := strconv.Unquote(value)
		labels[k] = v
	}
	return labels
}

// blocked says which goroutines of the dump carry label key (with value,
// unless value is ""), and where the most telling of them is blocked: the
// first in this service's own code (a phase's own goroutine rather than the
// pool it started), else the first. "GET /api/slow, blocked in
// main.handleSlow.func1 (drain_demo.go:47)": the values come first when
// value is "", each with its count when more than one. "" when no goroutine
// carries the label.
func (d goroutineDump) blocked(key, value string) string {
	own := ownPackage()
	var values []string
	counts := map[string]int{}
	var first, firstOwn *goroutineGroup
	for _, g := range d.groups() {
		v, ok := g.labels[key]
		if !ok || (value != "" && v != value) || g.watcher() {
			continue
		}
		if first == nil {
			first = &g
		}
		if firstOwn == nil && g.in(own) {
			firstOwn = &g
		}
		if counts[v] == 0 {
			values = append(values, v)
		}
		counts[v] += g.count
	}
	if first == nil {
		return ""
	}
	var parts []string
	if value == "" {
		for _, v := range values {
			if n := counts[v]; n > 1 {
				v = fmt.Sprintf("%s ×%d", v, n)
			}
			parts = append(parts, v)
		}
	}
	if where := cmp.Or(firstOwn, first).where(own); where != "" {
		parts = append(parts, "blocked in "+where)
	}
	return strings.Join(parts, ", ")
}

// in reports whether the goroutine runs code of package pkg.
func (g goroutineGroup) in(pkg string) bool {
	return slices.ContainsFunc(g.frames, func(f string) bool { return strings.HasPrefix(f, pkg) })
}

// watcher reports a goroutine that is taking this very dump.
func (g goroutineGroup) watcher() bool {
	return slices.ContainsFunc(g.frames, func(f string) bool { return strings.HasPrefix(f, "runtime/pprof.") })
}

// where is the innermost frame outside the runtime, and the innermost of
// this service's own code (package pkg) when that is another:
// "net.(*conn).Read ← main.(*heartbeats).clear (heartbeat.go:120)".
func (g goroutineGroup) where(pkg string) string {
	var outer, own string
	for _, f := range g.frames {
		if outer == "" && !runtimeFrame(f) {
			outer = f
		}
		if strings.HasPrefix(f, pkg) {
			own = f
			break
		}
	}
	switch {
	case outer == "" || outer == own:
		return own
	case own == "":
		return outer
	default:
		return outer + " ← " + own
	}
}

// ownPackage is the prefix of this package's function names in a stack:
// "main." in the binary, the module path's in its test binary.
func ownPackage() string {
	pc, _, _, _ := runtime.Caller(0)
	return strings.TrimSuffix(runtime.FuncForPC(pc).Name(), "ownPackage")
}

// runtimeFrame is a frame of the runtime's own waiting: where every blocked
// goroutine is, so it says nothing about why.
func runtimeFrame(f string) bool {
	for _, p := range []string{"runtime.", "internal/", "sync.", "syscall.", "time.Sleep"} {
		if strings.HasPrefix(f, p) {
			return true
		}
	}
	return false
}

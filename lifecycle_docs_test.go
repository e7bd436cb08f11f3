package main

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// (issue 48) The boot's and the drain's names are the code: the phases and
// drain steps a full service logs, in their order, are the ones the README,
// docs/operations.md, docs/design.md's phase table and shutdown.go's
// timeline comment name, in the same order — as docs/configuration.md is checked against the settings table.
// The names come from a real boot and drain with every dependency
// configured, so every release hook is there.
func TestBootAndDrainNamesAreTheDocs(t *testing.T) {
	readme := readDoc(t, "README.md") // before the boot: it works in a directory of its own
	operations := readDoc(t, "docs/operations.md")
	shutdownGo := readDoc(t, "shutdown.go")
	design := readDoc(t, "docs/design.md")
	s3 := testS3(t)
	env := fastEnv(t)
	env["MEILI_URL"] = newMeiliDouble(t, "available").srv.URL
	env["S3_ENDPOINT"], env["S3_ACCESS_KEY"], env["S3_SECRET_KEY"], env["S3_BUCKET"] = s3.Endpoint, s3.AccessKey, s3.SecretKey, "docs"
	s := startInProcess(t, env)
	if err := s.stop(t); err != nil {
		t.Fatalf("the drain failed: %v", err)
	}
	var phases, steps []string
	for _, l := range s.logs.lines() {
		if l["msg"] != "lifecycle" {
			continue
		}
		if p, ok := l["phase"].(string); ok && l["outcome"] != nil {
			phases = append(phases, p)
		}
		if st, ok := l["step"].(string); ok {
			steps = append(steps, st)
		}
	}
	// The release hooks are the steps between inFlight and telemetryFlush.
	first, last := slices.Index(steps, "inFlight"), slices.Index(steps, "telemetryFlush")
	if first < 0 || last < first {
		t.Fatalf("the drain's steps are not in the log: %v", steps)
	}
	hooks := steps[first+1 : last]
	t.Logf("phases: %v", phases)
	t.Logf("steps: %v", steps)

	// shutdown.go's timeline comment: every step, the hooks listed too.
	timeline := between(t, "shutdown.go", shutdownGo, "//\tstop request", "//\texit 0")
	sameOrder(t, "shutdown.go's timeline comment", steps, namesIn(timeline, steps))

	// docs/operations.md's drain: every step and every hook, in order.
	drain := between(t, "docs/operations.md", operations, "## The drain (shutdown.go)", "\n## ")
	sameOrder(t, "docs/operations.md's drain", steps, namesIn(drain, steps))

	// The README's walkthrough of a drain's log: the steps, the hooks as one
	// `step=<hook>`, and the state changes where they come.
	walk := between(t, "README.md", readme, "log then shows, in order:", "event=exit")
	want := slices.Concat(steps[:first+1], []string{"<hook>"}, steps[last:])
	sameOrder(t, "the README's drain walkthrough", want, namesIn(walk, slices.Concat(steps, []string{"<hook>"})))
	if i, j := strings.Index(walk, "draining→stopped"), strings.Index(walk, "step=telemetryFlush"); i < j {
		t.Errorf("the README's walkthrough puts state_changed draining→stopped before step=telemetryFlush; the code flushes first")
	}

	// The boot: docs/design.md's phase table, a row a phase.
	var table []string
	for _, m := range regexp.MustCompile("(?m)^\\| \\d+ \\| `(\\w+)` \\|").FindAllStringSubmatch(design, -1) {
		table = append(table, m[1])
	}
	sameOrder(t, "docs/design.md's phase table", phases, table)
	if len(hooks) == 0 {
		t.Error("no release hook ran")
	}
}

func readDoc(t *testing.T, path string) string {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(raw)
}

// between is the text of doc from the first from to the next to after it.
func between(t *testing.T, name, doc, from, to string) string {
	t.Helper()
	_, rest, ok := strings.Cut(doc, from)
	if !ok {
		t.Fatalf("%s: no %q", name, from)
	}
	text, _, _ := strings.Cut(rest, to)
	return text
}

// namesIn is the names of known that text mentions as words, each once, in
// the order of their first mention.
func namesIn(text string, known []string) []string {
	var found []string
	for _, w := range regexp.MustCompile(`<?[A-Za-z]+>?`).FindAllString(text, -1) {
		if slices.Contains(known, w) && !slices.Contains(found, w) {
			found = append(found, w)
		}
	}
	return found
}

// sameOrder fails unless got is want.
func sameOrder(t *testing.T, where string, want, got []string) {
	t.Helper()
	if !slices.Equal(want, got) {
		t.Errorf("%s names\n  %v\nthe code runs\n  %v\nmissing: %v", where, got, want, missing(want, got))
	}
}

// inOrder fails unless got's names come in want's order.
func inOrder(t *testing.T, where string, want, got []string) {
	t.Helper()
	var order []string
	for _, w := range want {
		if slices.Contains(got, w) {
			order = append(order, w)
		}
	}
	if !slices.Equal(order, got) {
		t.Errorf("%s names %v in another order than the code's %v", where, got, want)
	}
}

func missing(want, got []string) []string {
	var m []string
	for _, w := range want {
		if !slices.Contains(got, w) {
			m = append(m, w)
		}
	}
	return m
}

// Command flaketable reads the `go test -json` output of several runs of the
// same tests, one file a run, and prints which tests failed in how many runs,
// each with the first line its failure printed (a t.Error/t.Fatal line, a
// panic, a timeout). scripts/stress-test.sh runs the tests and calls it.
//
//	go run ./scripts/flaketable run-1.json run-2.json ...
//
// Lines that are not JSON (a script's own output around go test's) are
// skipped. It exits 1 when any run had a failure.
package main

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// event is one line of `go test -json` (test2json).
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
}

// failure is one test that failed in some of the runs.
type failure struct {
	name      string
	runs      []int  // the runs it failed in, from 1
	firstLine string // what it printed first when it failed in the earliest of them
}

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" {
		fmt.Fprintln(os.Stderr, "usage: flaketable RUN.json...  (the go test -json output of each run)")
		os.Exit(2)
	}
	failures := map[string]*failure{}
	src := newSources()
	for i, path := range os.Args[1:] {
		f, err := os.Open(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, "flaketable:", err)
			os.Exit(2)
		}
		failed, err := readRun(f, src)
		f.Close()
		if err != nil {
			fmt.Fprintf(os.Stderr, "flaketable: reading %s: %v\n", path, err)
			os.Exit(2)
		}
		for name, line := range failed {
			fl := failures[name]
			if fl == nil {
				fl = &failure{name: name, firstLine: line}
				failures[name] = fl
			}
			fl.runs = append(fl.runs, i+1)
		}
	}
	runs := len(os.Args) - 1
	if len(failures) == 0 {
		fmt.Printf("no test failed in %d runs\n", runs)
		return
	}
	list := make([]*failure, 0, len(failures))
	for _, fl := range failures {
		list = append(list, fl)
	}
	slices.SortFunc(list, func(a, b *failure) int {
		if d := len(b.runs) - len(a.runs); d != 0 {
			return d
		}
		return strings.Compare(a.name, b.name)
	})
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "failed\ttest\truns\tfirst failing line\n")
	for _, fl := range list {
		fmt.Fprintf(w, "%d/%d\t%s\t%s\t%s\n", len(fl.runs), runs, fl.name, joinInts(fl.runs), fl.firstLine)
	}
	w.Flush()
	os.Exit(1)
}

// failingLine is what a failure prints first: file_test.go:N: …, a panic,
// or the test binary's timeout.
var failingLine = regexp.MustCompile(`^\s*(\S+_test\.go:\d+: |panic: |fatal error: |test timed out|.*\[build failed\])`)

// testLine is the position a t.Log or t.Error line starts with.
var testLine = regexp.MustCompile(`^\s*(\S+_test\.go):(\d+): `)

// sources reads test files to tell a t.Log line from a failure's: go test
// prints both the same way, and a failing test's first line is often a log.
type sources struct {
	root   string              // the module's directory
	module string              // the module path, from go.mod
	files  map[string][]string // by path, the lines
}

// isLog reports whether line was printed by a t.Log or t.Logf call of
// package pkg, read from the source it names (run from the module's root).
func (s *sources) isLog(pkg, line string) bool {
	m := testLine.FindStringSubmatch(line)
	if m == nil {
		return false
	}
	dir := strings.TrimPrefix(strings.TrimPrefix(pkg, s.module), "/")
	path := filepath.Join(s.root, dir, m[1])
	lines, ok := s.files[path]
	if !ok {
		raw, _ := os.ReadFile(path) // an unreadable file: every line counts
		lines = strings.Split(string(raw), "\n")
		s.files[path] = lines
	}
	n, _ := strconv.Atoi(m[2])
	return n >= 1 && n <= len(lines) && strings.Contains(lines[n-1], ".Log")
}

func newSources() *sources {
	s := &sources{root: ".", files: map[string][]string{}}
	if mod, err := os.ReadFile("go.mod"); err == nil {
		for l := range strings.Lines(string(mod)) {
			if rest, ok := strings.CutPrefix(l, "module "); ok {
				s.module = strings.TrimSpace(rest)
			}
		}
	}
	return s
}

// readRun returns the tests that failed in one run, each with its first
// failing line. A subtest's failure also fails its parent: only the deepest
// failing tests are kept, so a table names the subtest, not its parents.
// A package that failed with no failing test (a build error, a crash between
// tests) is named as the package.
func readRun(r io.Reader, src *sources) (map[string]string, error) {
	firstLine := map[string]string{} // by "package.Test", the first failing line seen
	failed := map[string]bool{}
	packageFailed := map[string]bool{}
	packageLine := map[string]string{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var ev event
		if json.Unmarshal(sc.Bytes(), &ev) != nil || ev.Action == "" {
			continue
		}
		key := ev.Package
		if ev.Test != "" {
			key = shortPackage(ev.Package) + "." + ev.Test
		}
		switch ev.Action {
		case "output":
			line := strings.TrimRight(ev.Output, "\n")
			if failingLine.MatchString(line) && !src.isLog(ev.Package, line) {
				if ev.Test == "" {
					if packageLine[key] == "" {
						packageLine[key] = strings.TrimSpace(line)
					}
				} else if firstLine[key] == "" {
					firstLine[key] = strings.TrimSpace(line)
				}
			}
		case "fail":
			if ev.Test == "" {
				packageFailed[ev.Package] = true
			} else {
				failed[key] = true
			}
		}
	}
	out := map[string]string{}
	for name := range failed {
		deepest := true
		for other := range failed {
			if strings.HasPrefix(other, name+"/") {
				deepest = false
				break
			}
		}
		if deepest {
			out[name] = cmp.Or(firstLine[name], "(no failing line: see the run's output)")
		}
	}
	for pkg := range packageFailed {
		hasTest := false
		for name := range failed {
			hasTest = hasTest || strings.HasPrefix(name, shortPackage(pkg)+".")
		}
		if !hasTest {
			out["package "+pkg] = cmp.Or(packageLine[pkg], "(the package failed outside any test: see the run's output)")
		}
	}
	return out, sc.Err()
}

// shortPackage is the last element of an import path.
func shortPackage(p string) string { return p[strings.LastIndex(p, "/")+1:] }

func joinInts(ns []int) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = fmt.Sprint(n)
	}
	return strings.Join(s, ",")
}

package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A run's failures are its deepest failing tests, each with the first line
// of its failure: a t.Log line printed before it is told apart by its source.
func TestReadRunNamesTheDeepestFailureAndItsFirstErrorLine(t *testing.T) {
	root := t.TempDir()
	source := "package m\n\tt.Logf(\"the setup\")\n\tt.Errorf(\"want 1, got %d\", 2)\n"
	if err := os.WriteFile(filepath.Join(root, "m_test.go"), []byte(source), 0o644); err != nil {
		t.Fatal(err)
	}
	run := strings.Join([]string{
		`not JSON: a script's own line`,
		`{"Action":"run","Package":"example.com/m","Test":"TestA"}`,
		`{"Action":"output","Package":"example.com/m","Test":"TestA/sub","Output":"    m_test.go:2: the setup\n"}`,
		`{"Action":"output","Package":"example.com/m","Test":"TestA/sub","Output":"    m_test.go:3: want 1, got 2\n"}`,
		`{"Action":"fail","Package":"example.com/m","Test":"TestA/sub"}`,
		`{"Action":"fail","Package":"example.com/m","Test":"TestA"}`,
		`{"Action":"pass","Package":"example.com/m","Test":"TestB"}`,
		`{"Action":"fail","Package":"example.com/m"}`,
		`{"Action":"output","Package":"example.com/other","Output":"other.go:3:2: undefined: x [build failed]\n"}`,
		`{"Action":"fail","Package":"example.com/other"}`,
	}, "\n")
	src := &sources{root: root, module: "example.com/m", files: map[string][]string{}}
	got, err := readRun(strings.NewReader(run), src)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"m.TestA/sub":               "m_test.go:3: want 1, got 2",
		"package example.com/other": "other.go:3:2: undefined: x [build failed]",
	}
	if len(got) != len(want) {
		t.Fatalf("got %q, want %q", got, want)
	}
	for name, line := range want {
		if got[name] != line {
			t.Errorf("%s: got %q, want %q", name, got[name], line)
		}
	}
}

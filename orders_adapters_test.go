package main

import (
	"context"
	"strings"
	"testing"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// Search and storage are optional: up, they are checked; down, the boot warns
// and goes on, and readiness stays 200. Phases 11 and 12 connect only for a
// feature that uses them: here the orders, which use both.
func TestOptionalAdaptersUpAndDown(t *testing.T) {
	t.Run("up", func(t *testing.T) {
		s3 := testS3(t)
		env := fastEnv(t)
		meili := newMeiliDouble(t, "available")
		env["MEILI_URL"] = meili.srv.URL
		env["S3_ENDPOINT"], env["S3_ACCESS_KEY"], env["S3_SECRET_KEY"], env["S3_BUCKET"] = s3.Endpoint, s3.AccessKey, s3.SecretKey, "files"
		s := startInProcess(t, env)
		for _, phase := range []string{"searchAdapter", "fileStorage"} {
			if s.logs.find(map[string]any{"phase": phase, "outcome": "ok"}) == nil {
				t.Errorf("phase %s not ok", phase)
			}
		}
		for _, f := range s.app.features {
			for _, ix := range f.searchIndexes {
				if !meili.called("POST /indexes") || !meili.called("PUT /indexes/"+ix.uid+"/settings/searchable-attributes") {
					t.Errorf("phase 11 did not prepare the %s index of feature %s: %v", ix.uid, f.name, meili.calls)
				}
			}
		}
		client, _ := minio.New(s3.Endpoint, &minio.Options{Creds: credentials.NewStaticV4(s3.AccessKey, s3.SecretKey, "")})
		if ok, err := client.BucketExists(context.Background(), "files"); !ok || err != nil {
			t.Errorf("bucket not created by phase 12: %v %v", ok, err)
		}
		s.app.health.refresh(context.Background())
		rep, ok := s.app.health.report()
		if !ok || !rep.Checks["search"].OK || !rep.Checks["storage"].OK {
			t.Errorf("readiness %v %+v", ok, rep.Checks)
		}
	})
	t.Run("down", func(t *testing.T) {
		env := fastEnv(t, "MEILI_URL=http://"+freeTCPAddr(t), "S3_ENDPOINT="+freeTCPAddr(t), "S3_ACCESS_KEY=key", "S3_SECRET_KEY=secret-key-123")
		s := startInProcess(t, env)
		for _, phase := range []string{"searchAdapter", "fileStorage"} {
			if s.logs.find(map[string]any{"phase": phase, "outcome": "warn"}) == nil {
				t.Errorf("phase %s did not warn", phase)
			}
		}
		s.app.health.refresh(context.Background())
		rep, ok := s.app.health.report()
		if !ok || rep.Checks["search"].OK || rep.Checks["storage"].OK {
			t.Errorf("want ready with search and storage shown failing: %v %+v", ok, rep.Checks)
		}
		if strings.Contains(s.logs.String(), "secret-key-123") {
			t.Error("the S3 secret key was logged")
		}
	})
}

//! `GET /openapi.json`: the OpenAPI 3.0 document of the gateway, checked in beside this file and
//! tested against the route table (every route documented with its methods, and nothing else).

use axum::http::header;
use axum::response::IntoResponse;

/// The OpenAPI 3.0 document of the gateway's HTTP API.
pub const DOCUMENT: &str = include_str!("../openapi.json");

/// `GET /openapi.json`.
pub(crate) async fn document() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], DOCUMENT)
}

#[cfg(test)]
mod tests {
    use crate::server::{Access, route_table};
    use serde_json::Value;
    use std::collections::BTreeSet;

    fn doc() -> Value {
        serde_json::from_str(super::DOCUMENT).unwrap()
    }

    #[test]
    fn document_lists_exactly_the_routes_of_the_router() {
        let doc = doc();
        let mut documented = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                if method != "parameters" {
                    documented.insert((method.to_uppercase(), path.clone()));
                }
            }
        }
        let routed: BTreeSet<(String, String)> = route_table()
            .iter()
            .map(|(s, _)| (s.method.as_str().to_string(), s.path.to_string()))
            .collect();
        assert_eq!(documented, routed);
        assert_eq!(routed.len(), 17);
    }

    #[test]
    fn document_marks_exactly_the_public_routes_as_needing_no_token() {
        let doc = doc();
        assert_eq!(doc["security"], serde_json::json!([{ "bearer": [] }]));
        for (spec, _) in route_table() {
            let op = &doc["paths"][spec.path][spec.method.as_str().to_lowercase()];
            let public = op.get("security") == Some(&serde_json::json!([]));
            assert_eq!(
                public,
                spec.access == Access::Public,
                "{} {}",
                spec.method,
                spec.path
            );
            let codes: Vec<&String> = op["responses"].as_object().unwrap().keys().collect();
            if spec.access == Access::Token {
                assert!(
                    codes.iter().any(|c| *c == "401"),
                    "{} {}",
                    spec.method,
                    spec.path
                );
                assert!(
                    codes.iter().any(|c| *c == "403"),
                    "{} {}",
                    spec.method,
                    spec.path
                );
            }
        }
    }

    #[test]
    fn every_schema_reference_resolves() {
        let doc = doc();
        fn walk(v: &Value, doc: &Value, seen: &mut usize) {
            match v {
                Value::Object(m) => {
                    if let Some(Value::String(r)) = m.get("$ref") {
                        let name = r.trim_start_matches("#/components/schemas/");
                        assert!(
                            doc["components"]["schemas"].get(name).is_some(),
                            "dangling {r}"
                        );
                        *seen += 1;
                    }
                    m.values().for_each(|x| walk(x, doc, seen));
                }
                Value::Array(a) => a.iter().for_each(|x| walk(x, doc, seen)),
                _ => {}
            }
        }
        let mut seen = 0;
        walk(&doc, &doc, &mut seen);
        assert!(seen > 50, "only {seen} references");
    }
}
